import { credentials, type Interceptor, InterceptingCall } from "@grpc/grpc-js";
import { inject } from "vitest";
import { afterAll, describe, expect, it } from "vitest";
import { Client, InvalidArgumentError, ROUTING_KEY_HEADER } from "../src/index.js";
import { RuntimeServiceClient } from "../src/generated/kakeya/v1/runtime.js";
import { PROMPT } from "./support/fixtures.js";

/** Every call's method and routing key, recorded by a client interceptor on the real call path. */
const calls: Array<[string, string | undefined]> = [];
const recorder: Interceptor = (options, nextCall) =>
  new InterceptingCall(nextCall(options), {
    start(metadata, listener, next) {
      const keys = metadata.get(ROUTING_KEY_HEADER);
      calls.push([options.method_definition.path.split("/").pop() ?? "", keys.length ? String(keys[0]) : undefined]);
      next(metadata, listener);
    },
  });
const address = inject("daemonAddress");
const client = new Client(address, {
  timeoutMs: 60_000,
  grpcClient: new RuntimeServiceClient(address, credentials.createInsecure(), { interceptors: [recorder] }),
});
afterAll(() => client.close());

async function drain(stream: AsyncIterable<number>): Promise<void> {
  for await (const token of stream) void token;
}

describe("routing keys", () => {
  it("sends one random key with every call of a session and of its forks", async () => {
    calls.length = 0;
    const session = await client.createSession({ initialTokens: PROMPT });
    expect(session.routingKey).not.toBe(session.id);
    await session.append([5]);
    await drain(session.generate({ maxTokens: 2 }));
    await session.info();
    const conversation = await session.converse();
    await conversation.append([6]);
    await conversation.close();
    const fork = await session.fork();
    expect(fork.routingKey).toBe(session.routingKey);
    await fork.close();
    await session.close();
    const sessionCalls = calls.filter(([method]) => method !== "GetModelInfo");
    expect(new Set(sessionCalls.map(([method]) => method))).toEqual(
      new Set([
        "CreateSession",
        "AppendTokens",
        "Generate",
        "GetSessionInfo",
        "Converse",
        "ForkSession",
        "CloseSession",
      ]),
    );
    expect(new Set(sessionCalls.map(([, key]) => key))).toEqual(new Set([session.routingKey]));
    const other = await client.createSession({ initialTokens: PROMPT });
    expect(other.routingKey).not.toBe(session.routingKey);
    await other.close();
  });

  it("takes a key the client chooses; a reattached handle defaults to the session id", async () => {
    calls.length = 0;
    const session = await client.createSession({ initialTokens: PROMPT, routingKey: "tenant-7" });
    expect(session.routingKey).toBe("tenant-7");
    const again = client.session(session.id);
    expect(again.routingKey).toBe(session.id);
    await again.close();
    expect(calls.filter(([method]) => method !== "GetModelInfo").map(([, key]) => key)).toEqual([
      "tenant-7",
      session.id,
    ]);
  });

  it("refuses a key metadata cannot carry before sending", async () => {
    await expect(client.createSession({ routingKey: "" })).rejects.toBeInstanceOf(InvalidArgumentError);
    expect(() => client.session("abc", { routingKey: "a\nb" })).toThrow(InvalidArgumentError);
  });
});
