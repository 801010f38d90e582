import { afterAll, describe, expect, inject, it } from "vitest";
import { connectivityState, credentials } from "@grpc/grpc-js";
import { Client, KakeyaError, SessionNotFoundError, wire } from "../src/index.js";
import { PROMPT, sharedClient } from "./support/fixtures.js";

const client = sharedClient();
afterAll(() => client.close());

describe("Session", () => {
  it("connects to the daemon", async () => {
    await expect(client.ready({ timeoutMs: 10_000 })).resolves.toBeUndefined();
  });

  it("runs over an injected generated gRPC client, whose channel close() closes", async () => {
    const stub = new wire.RuntimeServiceClient(inject("daemonAddress"), credentials.createInsecure());
    const injected = new Client("injected", { grpcClient: stub });
    const session = await injected.createSession({ initialTokens: PROMPT });
    expect(session.historyLength).toBe(PROMPT.length);
    await session.close();
    injected.close();
    expect(stub.getChannel().getConnectivityState(false)).toBe(connectivityState.SHUTDOWN);
    await expect(injected.createSession()).rejects.toBeInstanceOf(KakeyaError);
  });

  it("creates a session with initial tokens, appends, describes and closes it", async () => {
    const session = await client.createSession({ initialTokens: PROMPT.slice(0, 5), label: "session-suite" });
    expect(session.id).toMatch(/^\S{16,}$/);
    expect(session.historyLength).toBe(5);

    expect(await session.append(PROMPT.slice(5))).toBe(PROMPT.length);
    const info = await session.info({ historyTailTokens: 4 });
    expect(info).toMatchObject({
      historyLength: PROMPT.length,
      pendingTokenCount: PROMPT.length,
      clientLabel: "session-suite",
      kvStrategy: "full",
      generating: false,
      inv1Violations: 0,
      inv2Violations: 0,
      historyTail: PROMPT.slice(-4),
    });

    expect(await session.close()).toBe(PROMPT.length);
    await expect(session.info()).rejects.toBeInstanceOf(SessionNotFoundError);
  });

  it("streams generated tokens into the history and reports the generation's statistics", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const stream = session.generate({ maxTokens: 6, seed: 11, temperature: 0.7 });
    const tokens: number[] = [];
    for await (const token of stream) tokens.push(token);

    expect(tokens).toHaveLength(6);
    expect(stream.stats).toMatchObject({
      stopReason: "max_tokens",
      generatedTokenCount: 6,
      prefillTokenCount: PROMPT.length,
    });
    expect(stream.stats?.verifierForwardCount).toBeGreaterThan(0);
    expect(session.lastStats).toEqual(stream.stats);

    const info = await session.info({ historyTailTokens: 6 });
    expect(info.historyLength).toBe(PROMPT.length + 6);
    // The last generated token is in the history but not yet in the cache: the next generation prefills it.
    expect(info.pendingTokenCount).toBe(1);
    expect(info.historyTail).toEqual(tokens);
    expect(info.kvLiveBytes).toBeGreaterThan(0);
    await session.close();
  });

  it("stops at a stop token, which is streamed, with stop reason eos", async () => {
    const probe = await client.createSession({ initialTokens: PROMPT });
    const greedy = await probe.generate({ maxTokens: 8 }).toArray();
    await probe.close();
    const stop = greedy[3]!;
    const expected = greedy.slice(0, greedy.indexOf(stop) + 1);

    const bySession = await client.createSession({ initialTokens: PROMPT, eosTokenIds: [stop] });
    expect(await bySession.generate({ maxTokens: 8 }).toArray()).toEqual(expected);
    expect(bySession.lastStats?.stopReason).toBe("eos");

    const byCall = await client.createSession({ initialTokens: PROMPT });
    expect(await byCall.generate({ maxTokens: 8, stopTokenIds: [stop] }).toArray()).toEqual(expected);
    expect(byCall.lastStats?.stopReason).toBe("eos");
    await Promise.all([bySession.close(), byCall.close()]);
  });

  it("gives the same seeded tokens however the history was delivered", async () => {
    const sampling = { maxTokens: 8, seed: 2024n, temperature: 0.9, topP: 0.95, topK: 50 };
    const whole = await client.createSession({ initialTokens: PROMPT });
    const pieces = await client.createSession();
    for (let i = 0; i < PROMPT.length; i += 3) await pieces.append(PROMPT.slice(i, i + 3));

    const fromWhole = await whole.generate(sampling).toArray();
    const fromPieces = await pieces.generate(sampling).toArray();
    expect(fromPieces).toEqual(fromWhole);
    await Promise.all([whole.close(), pieces.close()]);
  });

  it("continues a session across turns with the same tokens as a fresh session given the whole history", async () => {
    const continued = await client.createSession({ initialTokens: PROMPT });
    const first = await continued.generate({ maxTokens: 4 }).toArray();
    await continued.append([220, 84]);
    const second = await continued.generate({ maxTokens: 4 }).toArray();

    const fresh = await client.createSession({ initialTokens: [...PROMPT, ...first, 220, 84] });
    expect(await fresh.generate({ maxTokens: 4 }).toArray()).toEqual(second);
    await Promise.all([continued.close(), fresh.close()]);
  });

  it("addresses an existing session by id through client.session()", async () => {
    const created = await client.createSession({ initialTokens: PROMPT, label: "by-id" });
    const handle = client.session(created.id);
    expect(handle.historyLength).toBeUndefined();
    expect(await handle.append([1, 2, 3])).toBe(PROMPT.length + 3);
    expect((await created.info()).historyLength).toBe(PROMPT.length + 3);
    expect(await handle.close()).toBe(PROMPT.length + 3);
  });

  it("creates a sink_window session whose strategy and sizes the server reports", async () => {
    const session = await client.createSession({ kvStrategy: "sink_window", sinkTokens: 2, windowTokens: 8 });
    await session.append(PROMPT);
    await session.generate({ maxTokens: 2 }).toArray();
    const info = await session.info();
    expect(info).toMatchObject({ kvStrategy: "sink_window", sinkTokens: 2, windowTokens: 8 });
    expect(info.residentTokenCount).toBeLessThanOrEqual(10);
    expect(info.evictedTokenCount).toBe(info.historyLength - info.pendingTokenCount - info.residentTokenCount);
    await session.close();
  });

  it("reports truncated history at the start of a generation on a bounded session", async () => {
    const session = await client.createSession({ kvStrategy: "sink_window", sinkTokens: 2, windowTokens: 8 });
    await session.append(PROMPT);
    await session.generate({ maxTokens: 2 }).toArray();
    const evicted = (await session.info()).evictedTokenCount;
    expect(evicted).toBeGreaterThan(0);
    const stream = session.generate({ maxTokens: 1 });
    await stream.toArray();
    expect(stream.stats?.droppedTokenCount).toBeGreaterThanOrEqual(evicted);
    await session.close();
  });

  it("restores evicted positions under dlm_restore: no truncation, restoration bytes reported", async () => {
    const session = await client.createSession({ kvStrategy: "dlm_restore", sinkTokens: 2, windowTokens: 8 });
    await session.append(PROMPT);
    await session.generate({ maxTokens: 2 }).toArray();
    const info = await session.info();
    expect(info).toMatchObject({ kvStrategy: "dlm_restore", restoredTokenCount: 0, kvRestoredBytes: 0 });
    expect(info.evictedTokenCount).toBeGreaterThan(0);
    expect(info.kvRestorationStateBytes).toBeGreaterThan(0);
    expect(info.kvPeakRestoredBytes).toBeGreaterThan(0);
    // The bundled plan rebuilds layer 0 from the token ids: 4 bytes per committed position, reported apart.
    expect(info.historyTokenBytes).toBe(4 * (info.historyLength - 1));
    // The default proposer's n-gram index is the session's drafting state, reported apart.
    expect(info.draftStateBytes).toBeGreaterThan(0);
    expect(info.kvLiveBytes).toBe(
      info.kvResidentBytes + info.kvRestorationStateBytes + info.historyTokenBytes + info.draftStateBytes,
    );
    const stream = session.generate({ maxTokens: 1 });
    await stream.toArray();
    expect(stream.stats?.droppedTokenCount).toBe(0);
    await session.close();
  });
});
