/**
 * `@kakeya/runtime/tokenizer`: opt-in tokenization in JavaScript for applications that build token ids
 * themselves. Loads a local Hugging Face `tokenizer.json` (and `tokenizer_config.json` / `chat_template.jinja`
 * when present) with `@huggingface/tokenizers` and renders chat templates with `@huggingface/jinja`; nothing is
 * downloaded. Both libraries are optional peer dependencies: install them to use this module.
 */
import { readFile } from "node:fs/promises";
import { join } from "node:path";
import { KakeyaError } from "./errors.js";

/** A tokenizer or chat template could not be loaded or used. */
export class TokenizerError extends KakeyaError {}

/** A chat message as chat templates expect it; extra keys are passed to the template. */
export interface ChatMessage {
  role: string;
  content: string;
  [key: string]: unknown;
}

export interface ChatTemplateOptions {
  /** End the rendering with the header of an assistant turn (default `true`). */
  addGenerationPrompt?: boolean;
  /** Extra template variables, e.g. `{ enable_thinking: false }` for Qwen3 templates. */
  variables?: Record<string, unknown>;
}

interface HfTokenizer {
  encode(text: string, options?: { add_special_tokens?: boolean }): { ids: number[] };
  decode(ids: number[], options?: { skip_special_tokens?: boolean }): string;
  token_to_id(token: string): number | undefined;
}

interface HfTemplate {
  render(context: Record<string, unknown>): string;
}

type Config = Record<string, unknown>;

async function readText(path: string, what: string): Promise<string> {
  try {
    return await readFile(path, "utf8");
  } catch (error) {
    throw new TokenizerError(`cannot read ${what} ${path}: ${(error as Error).message}`, { cause: error });
  }
}

async function readOptional(path: string): Promise<string | undefined> {
  try {
    return await readFile(path, "utf8");
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code === "ENOENT") return undefined;
    throw new TokenizerError(`cannot read ${path}: ${(error as Error).message}`, { cause: error });
  }
}

function parseJson(text: string, path: string): Config {
  try {
    return JSON.parse(text) as Config;
  } catch (error) {
    throw new TokenizerError(`${path} is not valid JSON: ${(error as Error).message}`, { cause: error });
  }
}

async function importPeer<T>(name: string, load: () => Promise<T>): Promise<T> {
  try {
    return await load();
  } catch (error) {
    throw new TokenizerError(`the tokenizer helper needs the optional dependency ${name}: npm install ${name}`, {
      cause: error,
    });
  }
}

/** The content string of a special-token entry of `tokenizer_config.json` (a string or `{ content }`). */
function tokenText(value: unknown): string | undefined {
  if (typeof value === "string") return value;
  if (value !== null && typeof value === "object" && typeof (value as { content?: unknown }).content === "string") {
    return (value as { content: string }).content;
  }
  return undefined;
}

const SENTINEL = "\u0000kakeya-assistant-content\u0000";

/** A local Hugging Face tokenizer with its chat template. */
export class Tokenizer {
  private constructor(
    private readonly tokenizer: HfTokenizer,
    private readonly config: Config,
    private readonly template: HfTemplate | undefined,
  ) {}

  /** Load `tokenizer.json` from `directory`, with `tokenizer_config.json` and `chat_template.jinja` when present
   * (a `chat_template` key of the config is used when there is no `.jinja` file). */
  static async fromDirectory(directory: string): Promise<Tokenizer> {
    const configPath = join(directory, "tokenizer_config.json");
    const configText = await readOptional(configPath);
    const config = configText === undefined ? {} : parseJson(configText, configPath);
    const template = await readOptional(join(directory, "chat_template.jinja"));
    return Tokenizer.fromFile(join(directory, "tokenizer.json"), { config, chatTemplate: template });
  }

  /** Load one `tokenizer.json`; `config` is the parsed `tokenizer_config.json`, `chatTemplate` a Jinja source. */
  static async fromFile(
    tokenizerJsonPath: string,
    options: { config?: Config; chatTemplate?: string | undefined } = {},
  ): Promise<Tokenizer> {
    const tokenizerJson = parseJson(await readText(tokenizerJsonPath, "tokenizer file"), tokenizerJsonPath);
    const config = options.config ?? {};
    const { Tokenizer: HfTokenizerClass } = await importPeer(
      "@huggingface/tokenizers",
      () => import("@huggingface/tokenizers"),
    );
    let tokenizer: HfTokenizer;
    try {
      tokenizer = new HfTokenizerClass(tokenizerJson, config) as unknown as HfTokenizer;
    } catch (error) {
      throw new TokenizerError(`cannot build a tokenizer from ${tokenizerJsonPath}: ${(error as Error).message}`, {
        cause: error,
      });
    }
    const source =
      options.chatTemplate ?? (typeof config.chat_template === "string" ? config.chat_template : undefined);
    let template: HfTemplate | undefined;
    if (source !== undefined) {
      const { Template } = await importPeer("@huggingface/jinja", () => import("@huggingface/jinja"));
      try {
        template = new Template(source);
      } catch (error) {
        throw new TokenizerError(`cannot parse the chat template: ${(error as Error).message}`, { cause: error });
      }
    }
    return new Tokenizer(tokenizer, config, template);
  }

  /** Token ids of `text`; special tokens written in the text (e.g. `<|im_end|>`) map to their ids. */
  encode(text: string, options: { addSpecialTokens?: boolean } = {}): number[] {
    return this.tokenizer.encode(text, { add_special_tokens: options.addSpecialTokens ?? false }).ids;
  }

  decode(ids: Iterable<number>, options: { skipSpecialTokens?: boolean } = {}): string {
    const list = [...ids];
    if (list.length === 0) return "";
    return this.tokenizer.decode(list, { skip_special_tokens: options.skipSpecialTokens ?? false });
  }

  /** The id of one token string (e.g. `"<|im_end|>"`); throws `TokenizerError` for an unknown token. */
  tokenId(token: string): number {
    const id = this.tokenizer.token_to_id(token);
    if (id === undefined) throw new TokenizerError(`unknown token ${JSON.stringify(token)}`);
    return id;
  }

  /** The ids of the config's `eos_token` (empty when the config names none): pass them as `eosTokenIds`. */
  get eosTokenIds(): number[] {
    const eos = tokenText(this.config.eos_token);
    return eos === undefined ? [] : [this.tokenId(eos)];
  }

  get hasChatTemplate(): boolean {
    return this.template !== undefined;
  }

  /** Render `messages` with the chat template, as `apply_chat_template(..., tokenize=False)` does. */
  applyChatTemplate(messages: ChatMessage[], options: ChatTemplateOptions = {}): string {
    if (this.template === undefined) throw new TokenizerError("this tokenizer has no chat template");
    const specials: Record<string, string> = {};
    for (const key of ["bos_token", "eos_token", "pad_token", "unk_token"]) {
      const text = tokenText(this.config[key]);
      if (text !== undefined) specials[key] = text;
    }
    try {
      return this.template.render({
        ...specials,
        ...options.variables,
        messages,
        add_generation_prompt: options.addGenerationPrompt ?? true,
      });
    } catch (error) {
      throw new TokenizerError(`cannot render the chat template: ${(error as Error).message}`, { cause: error });
    }
  }

  /** Token ids of `messages` rendered with the chat template (no extra special tokens), ready to append. */
  tokensForChat(messages: ChatMessage[], options: ChatTemplateOptions = {}): number[] {
    return this.encode(this.applyChatTemplate(messages, options));
  }

  /**
   * The text the chat template writes after an assistant message's content (e.g. `"<|im_end|>\n"`). An
   * append-only session holds the generated tokens as they were; appending this (minus an EOS the model already
   * generated) closes the assistant turn before the next turn's tokens, without re-rendering earlier turns.
   */
  assistantSuffix(options: ChatTemplateOptions = {}): string {
    const rendered = this.applyChatTemplate(
      [
        { role: "user", content: "?" },
        { role: "assistant", content: SENTINEL },
      ],
      { ...options, addGenerationPrompt: false },
    );
    const at = rendered.lastIndexOf(SENTINEL);
    if (at < 0) throw new TokenizerError("the chat template does not render assistant content verbatim");
    return rendered.slice(at + SENTINEL.length);
  }

  /** An incremental decoder for a stream of generated ids. */
  streamDecoder(options: { skipSpecialTokens?: boolean } = {}): TextStreamDecoder {
    return new TextStreamDecoder(this, options.skipSpecialTokens ?? false);
  }
}

/**
 * Turns generated ids into text as they arrive. Byte-level tokens can split a character across ids, so text is
 * held back while the decoded tail is an incomplete character (U+FFFD) and released once it completes.
 */
export class TextStreamDecoder {
  private readonly ids: number[] = [];
  private prefixOffset = 0;
  private readOffset = 0;

  constructor(
    private readonly tokenizer: Tokenizer,
    private readonly skipSpecialTokens: boolean,
  ) {}

  /** Add one id; returns the text that became final (possibly empty). */
  push(id: number): string {
    this.ids.push(id);
    const options = { skipSpecialTokens: this.skipSpecialTokens };
    const prefix = this.tokenizer.decode(this.ids.slice(this.prefixOffset, this.readOffset), options);
    const text = this.tokenizer.decode(this.ids.slice(this.prefixOffset), options);
    if (text.length <= prefix.length || text.endsWith("\uFFFD")) return "";
    this.prefixOffset = this.readOffset;
    this.readOffset = this.ids.length;
    return text.slice(prefix.length);
  }

  /** The text still held back (an incomplete character is returned as decoded). */
  flush(): string {
    const options = { skipSpecialTokens: this.skipSpecialTokens };
    const prefix = this.tokenizer.decode(this.ids.slice(this.prefixOffset, this.readOffset), options);
    const text = this.tokenizer.decode(this.ids.slice(this.prefixOffset), options);
    this.prefixOffset = this.readOffset = this.ids.length;
    return text.slice(prefix.length);
  }
}
