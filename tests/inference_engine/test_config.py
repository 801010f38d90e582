import pytest

from inference_engine.config import BUNDLED_MODEL_DIR, ConfigError, ServerConfig, is_loopback
from inference_engine.config_sources import load_config


def test_defaults_bind_loopback_on_the_standard_port_and_serve_smollm2():
    config = load_config({}, environ={})
    assert (config.host, config.port) == ("127.0.0.1", 50051)
    assert config.model == "smollm2-135m-instruct"
    bundled = load_config({"model": "kakeya-tiny"}, environ={})
    assert bundled.model_dir == BUNDLED_MODEL_DIR and (BUNDLED_MODEL_DIR / "config.json").is_file()
    assert config.session_idle_ttl_s == 1800 and config.max_concurrent == 1
    assert config.http_port == -1, "the deprecated HTTP shim is off unless asked for"


def test_flags_beat_environment_which_beats_the_file(tmp_path):
    path = tmp_path / "kakeya.toml"
    path.write_text('kv_strategy = "sink_window"\nwindow = 64\nsink = 2\nport = 6000\n')
    environ = {"KAKEYA_WINDOW": "128", "KAKEYA_PORT": "7000"}
    config = load_config({"port": 8000, "sink": None}, config_file=str(path), environ=environ)
    assert config.kv_strategy == "sink_window"
    assert config.sink == 2 and config.window == 128 and config.port == 8000


def test_the_config_file_can_come_from_the_environment(tmp_path):
    path = tmp_path / "k.toml"
    path.write_text("max-sessions = 3\n")
    assert load_config({}, environ={"KAKEYA_CONFIG": str(path)}).max_sessions == 3


@pytest.mark.parametrize(
    ("text", "message"),
    [("bogus = 1\n", "unknown option"), ('port = "x"\n', "expected int"), ("port = [\n", "cannot read")],
)
def test_bad_config_files_are_rejected_with_the_option_named(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config({}, config_file=str(path), environ={})


@pytest.mark.parametrize(
    "overrides",
    [
        {"kv_strategy": "paged"},
        {"window": 0},
        {"max_concurrent": 0},
        {"session_idle_ttl_s": 0.0},
        {"port": 70000},
        {"http_port": -2},
        {"http_port": 65536},
        {"tls_cert": "a.pem"},
        {"backend": "jax"},
        {"sink": -1},
        {"prefill_chunk_tokens": -1},
        {"max_batch_size": -1},
        {"batch_wait_ms": -1.0},
        {"batch_wait_ms": 1001.0},
    ],
)
def test_invalid_values_are_rejected(overrides):
    with pytest.raises(ConfigError):
        ServerConfig(**overrides)


def test_non_loopback_binding_requires_an_api_key():
    with pytest.raises(ConfigError, match="without an API key"):
        ServerConfig(host="0.0.0.0")
    assert ServerConfig(host="0.0.0.0", api_key="k").host == "0.0.0.0"
    assert ServerConfig(host="::1").host == "::1"


def test_loopback_detection():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.5.5.5", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.0.0.1", "example.org", "::"))


def test_secrets_are_redacted_for_logs():
    assert ServerConfig(api_key="top").redacted()["api_key"] == "***"


def test_dflash_without_a_drafter_uses_the_model_directorys_own(tmp_path):
    bundled = load_config({"proposer": "dflash", "model": "kakeya-tiny"}, environ={})
    assert bundled.proposer_options().draft_model == BUNDLED_MODEL_DIR / "dflash"
    with pytest.raises(ConfigError, match="needs a model directory"):
        load_config({"proposer": "dflash"}, environ={})  # the default model ships no drafter
    explicit = load_config({"proposer": "dflash", "draft_model": str(tmp_path)}, environ={})
    assert explicit.proposer_options().draft_model == str(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="needs a model directory"):
        load_config({"proposer": "dflash", "model": str(tmp_path)}, environ={})
    with pytest.raises(ConfigError, match="needs a model directory"):
        load_config({"proposer": "draft_model"}, environ={})


def test_a_shared_journal_is_a_postgresql_url_given_instead_of_a_state_dir_and_masked_in_logs():
    config = ServerConfig(journal_url="postgresql://kakeya:pw@db:5432/kakeya", node_name="d1")
    assert config.redacted()["journal_url"] == "***"
    with pytest.raises(ConfigError, match="journal_url and state_dir"):
        ServerConfig(journal_url="postgresql://db/kakeya", state_dir="/tmp/state")
    with pytest.raises(ConfigError, match="postgresql://"):
        ServerConfig(journal_url="mysql://db/kakeya")


@pytest.mark.parametrize(
    ("proposer", "setting", "expected"),
    [("ngram", "auto", "cost"), ("draft_model", "auto", "adaptive"), ("ngram", "adaptive", "adaptive")],
)
def test_the_draft_policy_defaults_to_the_one_measured_faster_for_the_proposer(
    verifier_pool, tmp_path, proposer, setting, expected
):
    from kv_cache_proposer.proposers.base import DraftPolicy
    from tests.support.checkpoints import save_draft_model
    from tests.support.server import start_server

    assert ServerConfig().draft_policy == "auto"
    draft = {"draft_model": str(save_draft_model(tmp_path / "draft"))} if proposer == "draft_model" else {}
    server = start_server(
        verifier_pool.get("torch", "qwen3"),
        model_dir=verifier_pool.model_dir("torch", "qwen3"),
        proposer=proposer,
        draft_policy=setting,
        **draft,
    )
    try:
        assert server.server.runtime.decoder.draft_policy is DraftPolicy(expected)
    finally:
        server.stop()


def test_compile_comes_from_flags_the_environment_or_the_file_and_belongs_to_the_torch_backend(tmp_path):
    assert load_config({}, environ={}).compile == "auto"
    path = tmp_path / "kakeya.toml"
    path.write_text('compile = "on"\n')
    assert load_config({}, config_file=str(path), environ={}).compile == "on"
    assert load_config({}, config_file=str(path), environ={"KAKEYA_COMPILE": "off"}).compile == "off"
    assert load_config({"compile": "on"}, environ={"KAKEYA_COMPILE": "off"}).compile == "on"
    assert ServerConfig(backend="mlx").compile == "auto"
    with pytest.raises(ConfigError, match="compile on applies to the torch backend, not mlx"):
        ServerConfig(backend="mlx", compile="on")
    with pytest.raises(ConfigError, match="compile: 'always' is not one of auto, on, off"):
        load_config({}, environ={"KAKEYA_COMPILE": "always"})


def test_bfloat16_kv_is_a_choice_of_torchs_direct_forward():
    assert load_config({}, environ={}).kv_dtype == "auto"
    assert load_config({}, environ={"KAKEYA_KV_DTYPE": "model"}).kv_dtype == "model"
    assert ServerConfig(backend="mlx").kv_dtype == "auto"  # auto is the model's dtype there
    for backend, forward in (("mlx", "auto"), ("torch", "library")):
        with pytest.raises(ConfigError, match="kv_dtype bfloat16 needs torch's direct forward"):
            ServerConfig(backend=backend, torch_forward=forward, kv_dtype="bfloat16")
    with pytest.raises(ConfigError, match="kv_dtype: 'float16' is not one of auto, model, bfloat16"):
        load_config({}, environ={"KAKEYA_KV_DTYPE": "float16"})


def test_the_batch_size_defaults_to_the_backends_choice():
    assert ServerConfig().max_batch_size == ServerConfig(backend="mlx").max_batch_size == 0
    assert ServerConfig(backend="mlx", max_batch_size=4).max_batch_size == 4
