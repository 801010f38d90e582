"""Wire transports of the service."""
