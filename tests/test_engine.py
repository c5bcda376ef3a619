"""Engine input checks that need no worker processes: model folders, sampling parameters, layouts, the CLI.

Each bad input must fail with a message naming the parameter and the fix, before any rank starts.
"""

from __future__ import annotations

import json
import re

import pytest

from hsdp import ParallelConfig
from hsdp.cli import main as cli_main
from hsdp.engine import Engine, SamplingParams
from hsdp.engine.checks import layout_problems
from hsdp.engine.model_info import inspect_model
from hsdp.engine.params import build_requests
from hsdp.models.builtin import resolve_model

pytestmark = pytest.mark.slow  # builds the tiny models once (seconds), no worker processes

HSDP2 = ParallelConfig(use_hsdp=True, hsdp_shard_size=2).resolved()


@pytest.fixture(scope="module")
def wan_info(tmp_path_factory):
    return inspect_model(resolve_model("tiny-wan", cache_dir=tmp_path_factory.getbasetemp() / "hsdp-cache"))


@pytest.fixture(scope="module")
def llama_info(tmp_path_factory):
    return inspect_model(resolve_model("tiny-llama", cache_dir=tmp_path_factory.getbasetemp() / "hsdp-cache"))


def test_arguments_a_pipeline_config_turns_off_are_not_taken(wan_info, tmp_path):
    """Wan 2.1's folder leaves boundary_ratio unset, so WanPipeline refuses guidance_scale_2 (its check_inputs):
    not an argument of this pipeline; a folder that sets it (Wan 2.2's two experts) takes it (issue 27 item 9)."""
    assert wan_info.config_gated == {"guidance_scale_2": "boundary_ratio"}
    assert "guidance_scale_2" not in wan_info.call_params and "guidance_scale" in wan_info.call_params
    for entry in wan_info.path.iterdir():
        if entry.name != "model_index.json":
            (tmp_path / entry.name).symlink_to(entry)
    index = json.loads((wan_info.path / "model_index.json").read_text())
    (tmp_path / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": 0.875}))
    two_experts = inspect_model(tmp_path)
    assert two_experts.config_gated == {} and "guidance_scale_2" in two_experts.call_params


def test_model_info_reads_pipeline_and_lm_folders(wan_info, llama_info):
    assert wan_info.kind == "diffusion" and wan_info.class_name == "WanPipeline"
    assert (wan_info.spatial_multiple, wan_info.temporal_factor, wan_info.num_heads) == (16, 4, 2)
    assert wan_info.defaults["height"] == 32 and wan_info.defaults["num_inference_steps"] == 4
    assert llama_info.kind == "causal_lm"


def test_defaults_filled_and_seeds_per_request(wan_info):
    requests, params = build_requests(wan_info, HSDP2, ["a", "b"], SamplingParams(seed=7, height=48))
    assert [r.seed for r in requests] == [7, 8]
    assert (params.height, params.width, params.num_frames) == (48, 32, 5)
    requests, _ = build_requests(
        wan_info, HSDP2, ["a", "b"], SamplingParams(seed=[3, 9], negative_prompt=["x", "y"])
    )
    assert [(r.seed, r.negative_prompt) for r in requests] == [(3, "x"), (9, "y")]


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(height=40), "height=40 must be a positive multiple of 16"),
        (SamplingParams(width=0), "width=0 must be a positive multiple of 16"),
        (SamplingParams(num_frames=6), "num_frames=6 must be 4k+1"),
        (SamplingParams(num_inference_steps=0), "num_inference_steps=0 must be >= 1"),
        (SamplingParams(negative_prompt=["x"]), "negative_prompt has 1 entries but there are 2 prompts"),
        (SamplingParams(seed=[1, 2, 3]), "seed has 3 entries"),
    ],
)
def test_bad_video_params(wan_info, params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_requests(wan_info, HSDP2, ["a", "b"], params)


def test_prompts_must_match_the_layout(wan_info):
    request_parallel = ParallelConfig(use_hsdp=True, hsdp_shard_size=2, request_parallel=True).resolved()
    with pytest.raises(ValueError, match="pass a multiple of 2 prompts"):
        build_requests(wan_info, request_parallel, ["a", "b", "c"], SamplingParams())
    with pytest.raises(ValueError, match="no prompt given"):
        build_requests(wan_info, HSDP2, [], SamplingParams())
    cfg2 = ParallelConfig(use_hsdp=True, cfg_parallel_size=2).resolved()
    with pytest.raises(ValueError, match="--guidance-scale > 1"):
        build_requests(wan_info, cfg2, ["a"], SamplingParams(guidance_scale=1.0))
    ulysses4 = ParallelConfig(ulysses_degree=4).resolved()
    with pytest.raises(ValueError, match="not divisible by 4"):  # 2 latent frames x 3 x 1 tokens
        build_requests(wan_info, ulysses4, ["a"], SamplingParams(height=48, width=16))


def test_layout_problems(wan_info, llama_info, monkeypatch):
    assert layout_problems(wan_info, HSDP2) == []
    assert (
        "causal LMs run with HSDP"
        in layout_problems(llama_info, ParallelConfig(ulysses_degree=2).resolved())[0]
    )
    assert "attention heads" in layout_problems(wan_info, ParallelConfig(ulysses_degree=4).resolved())[0]
    assert "no CPU kernel" in layout_problems(wan_info, ParallelConfig(ring_degree=2).resolved())[0]
    frozen = ParallelConfig(use_hsdp=True, hsdp_shard_size=2, frozen_whole=True).resolved()
    assert "--frozen-whole) is a training setting" in layout_problems(wan_info, frozen)[0]


def test_more_ranks_than_devices_fails_before_spawning(wan_info, monkeypatch):
    import hsdp.distributed
    from hsdp.launch import group

    def no_ranks(*args, **kwargs):
        raise AssertionError("a worker group was started for a layout that should have been refused")

    monkeypatch.setattr(hsdp.distributed, "available_devices", lambda: 1)
    monkeypatch.setattr(group.WorkerGroup, "__init__", no_ranks)
    with pytest.raises(ValueError, match="needs 2 ranks on this host, one per device, but it has 1"):
        Engine(wan_info.path, HSDP2)


def test_unknown_model_and_non_pipeline_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither an existing path nor a built-in model"):
        Engine("no-such-model", HSDP2)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="not a model folder: no model_index.json"):
        Engine(tmp_path, HSDP2)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    with pytest.raises(ValueError, match="none of which is a causal LM"):
        Engine(tmp_path, HSDP2)


def _cli(capsys, *args: str) -> tuple[int, str]:
    code = cli_main(["generate", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nope"], "neither an existing path nor a built-in model"),
        (["--height", "40"], "height=40 must be a positive multiple of 16"),
        (["--num-frames", "8"], "num_frames=8 must be 4k+1"),
        (["--output", "cat.avi"], "a video needs one of .mp4, .gif"),
        (["--output", "cat.png"], "this pipeline makes video, not images; name the output cat.mp4"),
        (["--image", "cat.png"], "image: WanPipeline takes no image (drop --image)"),
        (["--true-cfg-scale", "4"], "true_cfg_scale: WanPipeline takes no true_cfg_scale"),
        (
            ["--guidance-scale-2", "3"],
            "guidance_scale_2: this WanPipeline takes no guidance_scale_2: its pipeline config (model_index.json) "
            "leaves boundary_ratio unset",
        ),
        (["--batch-size", "0"], "--batch-size 0: must be an integer >= 1"),
        (
            ["--model", "tiny-llama", "--batch-size", "2"],
            "causal LMs generate one request at a time per rank",
        ),
        (["--request-parallel", "--prompt", "b", "--prompt", "c"], "pass a multiple of 2 prompts"),
        (["--hsdp-shard-size", "-3"], "--hsdp-shard-size=-3 must be >= 1"),
    ],
)
def test_cli_rejects_bad_input_before_starting(capsys, monkeypatch, tmp_path_factory, args, message):
    """Refused with exit 2 before any rank starts: starting one would fail the test (not a timing: a loaded
    machine is slow either way)."""
    from hsdp.launch import group

    def no_ranks(*args, **kwargs):
        raise AssertionError("a worker group was started for input that should have been refused")

    monkeypatch.setenv("HSDP_CACHE", str(tmp_path_factory.getbasetemp() / "hsdp-cache"))
    monkeypatch.setattr(group.WorkerGroup, "__init__", no_ranks)
    base = ["--model", "tiny-wan", "--use-hsdp", "--hsdp-shard-size", "2", "--prompt", "a"]
    code, err = _cli(capsys, *base, *args)
    assert code == 2 and message in err, err


class _FailingGroup:
    """A stand-in worker group: loading succeeds, any later call fails as a broken group does."""

    world_size = 2
    broken = False

    def run(self, fn, *args, timeout_s=None, on_event=None):
        from hsdp.engine import worker
        from hsdp.launch import WorkerError

        if fn is worker.load:
            return [{"rank": r} for r in range(self.world_size)]
        self.broken = True
        raise WorkerError(f"{fn.__name__} failed on rank 1", rank=1)


def test_worker_failure_in_memory_report_closes_the_engine(llama_info):
    from hsdp.launch import WorkerError

    engine = Engine(llama_info.path, HSDP2, workers=_FailingGroup())
    with pytest.raises(WorkerError, match="memory_report failed"):
        engine.memory_report()
    assert engine.closed
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate("again")


@pytest.mark.parametrize(
    "params, needle",
    [
        (SamplingParams(pipeline_kwargs=[1]), "pipeline_kwargs=[1] must be a dict (a JSON object for --pipeline-kwargs)"),
        (SamplingParams(cache="first-block", cache_config="x"), "cache_config='x' must be a dict"),
    ],
)
def test_mappings_that_are_not_dicts_are_named(wan_info, params, needle):
    """The Python API's counterpart of the CLI's JSON-object flags (issue 27 item 12: a TypeError traceback)."""
    with pytest.raises(ValueError, match=re.escape(needle)):
        build_requests(wan_info, HSDP2, ["x"], params)


def test_batches_are_consecutive_chunks_when_inputs_are_alike():
    from hsdp.engine.params import Request, lockstep_rounds

    plain = [Request(i, "p", i) for i in range(5)]
    assert [[r.request_id for r in g] for [g] in lockstep_rounds(plain, 1, 2)] == [[0, 1], [2, 3], [4]]


def test_inputs_a_pipeline_takes_one_of_are_never_batched(tmp_path_factory):
    """Wan image-to-video's own check takes one image per call, not one per prompt: requests that give one run
    one per rank per round, the others batched (issue 27 item 10: hsdp generate --batch-size 2 passed a list)."""
    from PIL import Image

    from hsdp.engine.params import Request, lockstep_rounds

    i2v = inspect_model(resolve_model("tiny-wan-i2v", cache_dir=tmp_path_factory.getbasetemp() / "hsdp-cache"))
    assert i2v.single_inputs == {"image"}
    image = Image.new("RGB", (32, 32))
    requests = [Request(0, "p", 0), Request(1, "p", 1, image=image), Request(2, "p", 2, image=image)]
    requests += [Request(3, "p", 3)]
    rounds = lockstep_rounds(requests, 2, 2, i2v.single_inputs)
    assert [[[r.request_id for r in g] for g in groups] for groups in rounds] == [[[0], [3]], [[1], [2]]]
    assert [[[r.request_id for r in g] for g in groups] for groups in lockstep_rounds(requests, 1, 2, i2v.single_inputs)] == [
        [[0, 3]],
        [[1]],
        [[2]],
    ]
