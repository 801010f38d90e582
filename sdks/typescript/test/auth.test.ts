import { execFile } from "node:child_process";
import { mkdtemp, readFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { promisify } from "node:util";
import { status } from "@grpc/grpc-js";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { Client, type ClientOptions, UnauthenticatedError, UnavailableError } from "../src/index.js";
import { type Daemon, startDaemon } from "./support/daemon.js";
import { PROMPT } from "./support/fixtures.js";

// One daemon that requires an API key and serves TLS with a self-signed certificate made for this run.
const API_KEY = "test-key-7f3a";
let daemon: Daemon;
let rootCerts: Buffer;

async function selfSignedCertificate(): Promise<{ cert: string; key: string }> {
  const dir = await mkdtemp(join(tmpdir(), "kakeya-tls-"));
  const cert = join(dir, "cert.pem");
  const key = join(dir, "key.pem");
  await promisify(execFile)("openssl", [
    ...["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"],
    ...["-addext", "subjectAltName=DNS:localhost", "-keyout", key, "-out", cert],
  ]).catch((error: unknown) => {
    throw new Error(`openssl is needed to make the test certificate: ${(error as Error).message}`);
  });
  return { cert, key };
}

/** The daemon's address by host name: the certificate names `localhost`, and TLS server names are not IPs. */
function tlsAddress(): string {
  return daemon.address.replace(/^127\.0\.0\.1:/, "localhost:");
}

function tlsClient(options: ClientOptions = {}): Client {
  return new Client(tlsAddress(), { tls: { rootCerts }, ...options });
}

beforeAll(async () => {
  const { cert, key } = await selfSignedCertificate();
  rootCerts = await readFile(cert);
  daemon = await startDaemon(["--api-key", API_KEY, "--tls-cert", cert, "--tls-key", key]);
});
afterAll(async () => {
  await daemon?.stop();
});

describe("authentication and TLS", () => {
  it("a client without an API key fails with UnauthenticatedError", async () => {
    const client = tlsClient();
    const error = await client.createSession().catch((e: unknown) => e);
    expect(error).toBeInstanceOf(UnauthenticatedError);
    expect((error as UnauthenticatedError).code).toBe(status.UNAUTHENTICATED);
    client.close();
  });

  it("a wrong API key fails every kind of call with UnauthenticatedError", async () => {
    const client = tlsClient({ apiKey: "wrong" });
    const session = client.session("whatever");
    await expect(client.createSession()).rejects.toBeInstanceOf(UnauthenticatedError);
    await expect(session.generate({ maxTokens: 1 }).toArray()).rejects.toBeInstanceOf(UnauthenticatedError);
    await expect(session.converse()).rejects.toBeInstanceOf(UnauthenticatedError);
    client.close();
  });

  it("the right API key over TLS is accepted on unary, streaming and bidirectional calls", async () => {
    const client = tlsClient({ apiKey: API_KEY });
    const session = await client.createSession({ initialTokens: PROMPT });
    expect(await session.generate({ maxTokens: 2 }).toArray()).toHaveLength(2);
    const conversation = await session.converse();
    expect(await conversation.append([1])).toBe(PROMPT.length + 3);
    await conversation.close();
    await session.close();
    client.close();
  });

  it("a plaintext client cannot talk to the TLS server", async () => {
    const client = new Client(daemon.address, { apiKey: API_KEY, timeoutMs: 10_000 });
    await expect(client.createSession()).rejects.toBeInstanceOf(UnavailableError);
    client.close();
  });

  it("a TLS client that does not trust the server's certificate cannot connect", async () => {
    const client = new Client(tlsAddress(), { apiKey: API_KEY, tls: true, timeoutMs: 10_000 });
    await expect(client.createSession()).rejects.toBeInstanceOf(UnavailableError);
    client.close();
  });
});
