import { status } from "@grpc/grpc-js";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { Client, UnauthenticatedError } from "../src/index.js";
import { type Daemon, startDaemon } from "./support/daemon.js";
import { PROMPT } from "./support/fixtures.js";

const API_KEY = "test-key-7f3a";
let daemon: Daemon;

beforeAll(async () => {
  daemon = await startDaemon(["--api-key", API_KEY]);
});
afterAll(async () => {
  await daemon?.stop();
});

describe("authentication", () => {
  it("a client without an API key fails with UnauthenticatedError", async () => {
    const client = new Client(daemon.address);
    const error = await client.createSession().catch((e: unknown) => e);
    expect(error).toBeInstanceOf(UnauthenticatedError);
    expect((error as UnauthenticatedError).code).toBe(status.UNAUTHENTICATED);
    client.close();
  });

  it("a wrong API key fails every kind of call with UnauthenticatedError", async () => {
    const client = new Client(daemon.address, { apiKey: "wrong" });
    const session = client.session("whatever");
    await expect(client.createSession()).rejects.toBeInstanceOf(UnauthenticatedError);
    await expect(session.generate({ maxTokens: 1 }).toArray()).rejects.toBeInstanceOf(UnauthenticatedError);
    await expect(session.converse()).rejects.toBeInstanceOf(UnauthenticatedError);
    client.close();
  });

  it("the right API key is accepted on unary, streaming and bidirectional calls", async () => {
    const client = new Client(daemon.address, { apiKey: API_KEY });
    const session = await client.createSession({ initialTokens: PROMPT });
    expect(await session.generate({ maxTokens: 2 }).toArray()).toHaveLength(2);
    const conversation = await session.converse();
    expect(await conversation.append([1])).toBe(PROMPT.length + 3);
    await conversation.close();
    await session.close();
    client.close();
  });
});
