/** A single-consumer queue between a push-based event source (a gRPC stream) and an async reader. */
export class EventQueue<T> {
  private readonly items: T[] = [];
  private waiter:
    { resolve: (result: IteratorResult<T, undefined>) => void; reject: (error: unknown) => void } | undefined;
  private ended = false;
  private failure: { error: unknown } | undefined;

  /** Called when the buffer drains below the high-water mark again (to resume a paused source). */
  onDrain: (() => void) | undefined;

  constructor(readonly highWaterMark = 256) {}

  get size(): number {
    return this.items.length;
  }

  get closed(): boolean {
    return this.ended || this.failure !== undefined;
  }

  /** Add an item (dropped once the queue is closed); returns false when the buffer is at its high-water mark and
   * the source should pause until `onDrain`. */
  push(item: T): boolean {
    if (this.closed) return true;
    if (this.waiter !== undefined) {
      const { resolve } = this.waiter;
      this.waiter = undefined;
      resolve({ value: item, done: false });
      return true;
    }
    this.items.push(item);
    return this.items.length < this.highWaterMark;
  }

  /** No more items will come; buffered ones are still delivered. */
  end(): void {
    if (this.closed) return;
    this.ended = true;
    this.settleWaiter();
  }

  /** The source failed; buffered items are still delivered, then `next` rejects with `error`. */
  fail(error: unknown): void {
    if (this.closed) return;
    this.failure = { error };
    this.settleWaiter();
  }

  next(): Promise<IteratorResult<T, undefined>> {
    if (this.waiter !== undefined) return Promise.reject(new Error("EventQueue has a single reader"));
    if (this.items.length > 0) {
      const value = this.items.shift() as T;
      if (this.items.length === this.highWaterMark - 1) this.onDrain?.();
      return Promise.resolve({ value, done: false });
    }
    if (this.failure !== undefined) return Promise.reject(this.failure.error);
    if (this.ended) return Promise.resolve({ value: undefined, done: true });
    return new Promise((resolve, reject) => {
      this.waiter = { resolve, reject };
    });
  }

  private settleWaiter(): void {
    const waiter = this.waiter;
    if (waiter === undefined) return;
    this.waiter = undefined;
    if (this.failure !== undefined) waiter.reject(this.failure.error);
    else waiter.resolve({ value: undefined, done: true });
  }
}
