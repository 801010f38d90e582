import { afterAll, describe, expect, it } from "vitest";
import { InvalidArgumentError } from "../src/index.js";
import { PROMPT, sharedClient } from "./support/fixtures.js";

const client = sharedClient();
afterAll(() => client.close());

describe("KV compression options", () => {
  it("creates a session whose committed K/V the server holds as packed KakeyaLattice codes", async () => {
    const packed = await client.createSession({ initialTokens: PROMPT, kvCompressor: "kakeya_d4", kvQRange: 10 });
    const dense = await client.createSession({ initialTokens: PROMPT, kvCompressor: "none" });
    for (const session of [packed, dense]) {
      for await (const token of session.generate({ maxTokens: 3 })) expect(token).toBeGreaterThanOrEqual(0);
    }
    const packedInfo = await packed.info();
    const denseInfo = await dense.info();
    expect(packedInfo).toMatchObject({ kvCompressor: "kakeya_d4", kvQRange: 10 });
    expect(denseInfo).toMatchObject({ kvCompressor: "none", kvQRange: 0, kvCompressedBytes: 0 });
    expect(packedInfo.kvCompressedBytes).toBeGreaterThan(0);
    expect(packedInfo.kvDenseEquivalentBytes).toBe(denseInfo.kvDenseEquivalentBytes);
    expect(packedInfo.kvLiveBytes).toBeLessThan(denseInfo.kvLiveBytes);
    await packed.close();
    await dense.close();
  });

  it("refuses an unknown compressor before sending and a bad Q on the server", async () => {
    await expect(client.createSession({ kvCompressor: "zstd" as never })).rejects.toBeInstanceOf(InvalidArgumentError);
    await expect(client.createSession({ kvCompressor: "kakeya_e8", kvQRange: 500 })).rejects.toBeInstanceOf(
      InvalidArgumentError,
    );
  });
});
