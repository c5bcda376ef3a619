"""The feature axes of hsdp, named once as data, and the pairwise cases the combination tier runs (issue 27).

Every value of every axis meets every value of every other axis in at least one case (a pairwise covering array
from ``covertable``), except where a rule says the pair cannot be run. The cases run on ``tiny-wan``, except those of
a value that implies its model (:data:`IMPLIED_MODELS`: Wan 2.2's two-expert adapter, the speech route of an audio
pipeline, LTX-2's video with its sound): those values meet every value of every other axis in cases of their own
(each value at least once: a pair of the implied value with another axis's value needs only one case; covertable at
strength 1), and the pairs of two other axes stay with the tiny-wan array. The rules:

- ``refused``: the product refuses the pair before loading, with a message naming both flags; each such pair is
  a case of its own whose expected outcome is that refusal (:data:`REFUSED`).
- ``inapplicable``: no command or request expresses the pair (a synchronous request is not stored, so there is
  nothing to find after a restart); nothing to run (:data:`INAPPLICABLE`).
- ``cost`` rules exclude a *triple* (never a pair), to keep costly settings on few hosts: each pair they touch
  stays reachable through other cases, which :func:`uncovered_pairs` checks.

``python -m tests.compose_axes`` prints the cases; ``python -m tests.compose_axes --docs`` writes the tables of
docs/compose.md (``tests/test_compose.py`` checks they are in sync).
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from pathlib import Path

AXES: dict[str, dict[str, str]] = {
    "layout": {
        "one-process": "no parallel flags (one rank)",
        "hsdp2": "`--use-hsdp --hsdp-shard-size 2`",
        "ulysses2": "`--use-hsdp --ulysses-degree 2`",
        "cfg2": "`--use-hsdp --cfg-parallel-size 2`",
        "request-parallel2": "`--use-hsdp --hsdp-shard-size 2 --request-parallel`",
        "torchrun-2-nodes": "two `torchrun --nnodes 2 --nproc-per-node 1` agents, `--use-hsdp --hsdp-shard-size 2`",
    },
    "cache": {
        "none": "no `--cache`",
        "first-block": '`--cache first-block --cache-config \'{"threshold": 0.2}\'`',
        "taylorseer": "`--cache taylorseer` (hooks the attention layers inside each block)",
    },
    "batching": {
        "alone": "one request",
        "beside": "a second request (other prompt and seed) in the same batch: `--batch-size 2` / `--max-batch-size 2`; "
        "on a server the runner's batch statistics (`/metrics`) show the engine call that held both",
    },
    "adapter": {
        "none": "the base",
        "one": "`--lora x=DIR`, request `model: x`",
        "rotation": "`--lora x=DIR --lora y=DIR`, requests for x then y",
        "scale": '`lora: {"name": "x", "scale": 0.5}` (`adapter_scale=0.5`)',
        "runtime": "`POST /v1/load_lora_adapter` of a ComfyUI LoRA file (`Engine.add_adapter`), then `model: late`",
        "composed": '`lora: [{"name": "x"}, {"name": "kohya", "local_path": "kohya.safetensors", "scale": 0.5}]`: '
        "a peft adapter and a kohya (musubi-tuner) LoRA file in one request (`adapter=[x, kohya]`)",
        "two-expert": "Wan 2.2 A14B-shaped (tiny-wan with a second, low-noise expert `transformer_2` below "
        "`boundary_ratio` 0.875, tests/compose_models.py): `--lora w=DIR` of an export with an adapter for each "
        "expert (`DIR/transformer`, `DIR/transformer_2`), request `model: w`",
    },
    "compile": {"off": "no `--compile`", "on": "`--compile` (regional torch.compile)"},
    "route": {
        "generate": "`hsdp generate` / `Engine.generate`",
        "images": "`POST /v1/images/generations`",
        "chat": "`POST /v1/chat/completions`",
        "videos": "`POST /v1/videos`, polled, `GET .../content`",
        "speech": "`POST /v1/audio/speech` (`response_format: wav`) on `tiny-stable-audio`: the waveform",
        "sound": "`POST /v1/videos` on a tiny LTX-2 (tests/audio_pipelines.py), polled, `GET .../content`: the "
        "mp4's picture and its sound track",
    },
    "vae": {
        "whole": "no `--vae-parallel`: rank 0 decodes whole",
        "parallel": "`--vae-parallel`: the whole decode's rows split over the ranks that share a request (64 x 64, "
        "so each of 2 ranks decodes 4 of the 8 latent rows)",
    },
    "offload": {"off": "no `--offload-layers`", "on": "`--offload-layers 1` (the blocks after the first from host memory)"},
    "attention": {"default": "diffusers' default backend", "math": "`--attention-backend _native_math`"},
    "weights": {"stored": "no `--weight-dtype`", "int8": "`--weight-dtype int8` (8-bit shards)"},
    "lifecycle": {
        "plain": "nothing happens",
        "killed": "a worker rank is SIGKILLed while the job runs",
        "restarted": "the server stops with the job queued and starts again on the same `--output-dir`",
    },
}
"""Axis -> value -> how a user asks for it. The model is ``tiny-wan`` (the one built-in pipeline every route,
cache and layout applies to), except for the values of :data:`IMPLIED_MODELS`."""

IMPLIED_MODELS = {
    ("adapter", "two-expert"): "wan2.2-a14b",
    ("route", "speech"): "tiny-stable-audio",
    ("route", "sound"): "tiny-ltx2",
}
"""Values that imply another model than ``tiny-wan`` (what makes them: tests/test_compose.py ``MODELS``)."""
BASE_MODEL = "tiny-wan"


def model_of(values: dict[str, str]) -> str:
    """The model a case (or a partial row) runs on."""
    return next((m for (axis, value), m in IMPLIED_MODELS.items() if values.get(axis) == value), BASE_MODEL)


SERVER_ROUTES = ("images", "chat", "videos", "speech", "sound")


@dataclass(frozen=True)
class Rule:
    """A combination excluded from the covering array: each axis named in ``when`` takes one of its values."""

    when: dict[str, tuple[str, ...]]
    kind: str
    """``refused``, ``inapplicable`` or ``cost`` (see the module's docstring)."""
    why: str
    says: tuple[str, ...] = field(default=())
    """``refused``: what the refusal's message must contain (both flags)."""
    base: dict[str, str] = field(default_factory=dict)
    """``refused``: the other axes' values of its case, where the plainest would meet another refusal."""

    def matches(self, row: dict[str, str]) -> bool:
        return all(axis in row and row[axis] in values for axis, values in self.when.items())

    def decided(self, row: dict[str, str]) -> bool:
        return all(axis in row for axis in self.when)


REFUSED = (
    Rule(
        {"compile": ("on",), "cache": ("taylorseer",)},
        "refused",
        "TaylorSeer hooks the attention layers inside each compiled block; its per-step state would recompile "
        "the block every step",
        says=("--compile with --cache taylorseer", "first-block or magcache"),
    ),
    Rule(
        {"weights": ("int8",), "layout": ("one-process",)},
        "refused",
        "8-bit weights are stored as FSDP shards: one process has none",
        says=("--weight-dtype int8", "--use-hsdp"),
    ),
    Rule(
        {"weights": ("int8",), "adapter": tuple(v for v in AXES["adapter"] if v != "none")},
        "refused",
        "the 8-bit path would quantize the adapter slots' own Linear layers too",
        says=("--lora with --weight-dtype int8", "merge"),
        base={"layout": "hsdp2"},
    ),
    Rule(
        {"vae": ("parallel",), "layout": ("one-process", "request-parallel2")},
        "refused",
        "no two ranks share a request to split its decode over",
        says=("--vae-parallel",),
    ),
    Rule(
        {"offload": ("on",), "layout": ("one-process",)},
        "refused",
        "--offload-layers streams sharded blocks: without --use-hsdp there are none",
        says=("--offload-layers", "--use-hsdp"),
    ),
    Rule(
        {"attention": ("math",), "layout": ("ulysses2",)},
        "refused",
        "diffusers' _native_math backend has no context-parallel support",
        says=("--attention-backend _native_math", "--ulysses-degree"),
    ),
    Rule(
        {"route": ("speech",), "layout": ("ulysses2",)},
        "refused",
        "Stable Audio's DiT has no diffusers context-parallel plan (`_cp_plan`) to split its attention by",
        says=("--ulysses-degree", "StableAudioPipeline", "no diffusers context-parallel plan"),
    ),
    Rule(
        {"route": ("speech",), "layout": ("cfg2",)},
        "refused",
        "StableAudioPipeline batches both guidance branches into one denoiser call: no second pass to split off",
        says=("--cfg-parallel-size 2", "StableAudioPipeline", "separate unconditional pass"),
    ),
    Rule(
        {"route": ("sound",), "layout": ("cfg2",)},
        "refused",
        "LTX2Pipeline batches both guidance branches into one denoiser call: no second pass to split off",
        says=("--cfg-parallel-size 2", "LTX2Pipeline", "separate unconditional pass"),
    ),
    Rule(
        {"route": ("sound",), "layout": ("ulysses2",)},
        "refused",
        "diffusers' context-parallel plan for LTX-2 splits the video tokens only, not the audio stream its blocks "
        "attend to (diffusers fails on it too: found by this tier)",
        says=("--ulysses-degree", "audio stream"),
    ),
    Rule(
        {"route": ("speech",), "cache": ("first-block", "taylorseer")},
        "refused",
        "Stable Audio's DiT is no diffusers `CacheMixin`: diffusers has no step cache for it",
        says=("--cache first-block", "StableAudioDiTModel", "no diffusers step-cache support"),
    ),
    Rule(
        {"route": ("sound",), "cache": ("first-block",)},
        "refused",
        "diffusers' first-block cache has no registration of LTX-2's block class (its hook cannot find the block's "
        "outputs): `enable_cache` itself raises",
        says=("--cache first-block", "LTX2VideoTransformer3DModel", "not registered"),
    ),
    Rule(
        {"route": ("speech",), "adapter": ("runtime", "composed")},
        "refused",
        "a LoRA file of another tool (ComfyUI, kohya) is read by the pipeline's own converters "
        "(`lora_state_dict`), and diffusers' StableAudioPipeline has no LoRA loader (peft adapter folders apply)",
        says=("--lora", "lora_state_dict", "StableAudioPipeline has none"),
    ),
)
INAPPLICABLE = (
    Rule(
        {"route": ("generate",), "lifecycle": ("killed", "restarted")},
        "inapplicable",
        "`hsdp generate` / `Engine` has no supervisor and no queue: a killed worker is a `WorkerDiedError` and the "
        "engine closes (tests/test_engine_failures.py)",
    ),
    Rule(
        {"route": ("images", "chat", "speech"), "lifecycle": ("restarted",)},
        "inapplicable",
        "image, chat and speech requests are answered on their connection and not stored: a stopped server has no "
        "such job to run again",
    ),
    Rule(
        {"adapter": ("two-expert",), "route": ("speech", "sound")},
        "inapplicable",
        "each implies its own model (the two-expert adapter Wan 2.2's experts, the speech route an audio pipeline, "
        "the sound route LTX-2): no model is both",
    ),
)
COST = (
    Rule(
        {"layout": ("torchrun-2-nodes",), "route": SERVER_ROUTES, "cache": ("first-block", "taylorseer")},
        "cost",
        "server-wide settings vary on the single-host servers only (each torchrun server is two agents started "
        "anew); the torchrun layout meets every cache through Engine.generate",
    ),
    Rule(
        {"layout": ("torchrun-2-nodes",), "route": SERVER_ROUTES, "compile": ("on",)},
        "cost",
        "as above, for --compile",
    ),
    *(
        Rule({"layout": ("torchrun-2-nodes",), "route": SERVER_ROUTES, axis: (value,)}, "cost", f"as above, for {flag}")
        for axis, value, flag in (
            ("vae", "parallel", "--vae-parallel"),
            ("offload", "on", "--offload-layers"),
            ("attention", "math", "--attention-backend"),
            ("weights", "int8", "--weight-dtype"),
        )
    ),
    Rule(
        {"layout": ("torchrun-2-nodes",), "route": SERVER_ROUTES, "adapter": ("two-expert",)},
        "cost",
        "as above, for Wan 2.2's two-expert adapter (a model of its own): the torchrun layout meets it through "
        "Engine.generate, in the one torchrun launch of every generate case",
    ),
    Rule(
        {
            "compile": ("on",),
            "lifecycle": ("killed", "restarted"),
            "layout": tuple(v for v in AXES["layout"] if v != "one-process"),
        },
        "cost",
        "a killed worker's new group, and a restarted server, compile the blocks again (minutes on a CPU): "
        "--compile meets those lifecycles at one process only",
    ),
    Rule(
        {"layout": ("request-parallel2",), "route": ("generate",), "batching": ("alone",)},
        "cost",
        "Engine.generate under --request-parallel takes a multiple of its 2 request slots (one prompt is refused "
        "naming --request-parallel); the server pads a lone request, which the server routes cover",
    ),
)
IMPLIED_COST = tuple(
    Rule(
        {axis: (value,), "compile": ("on",), **when},
        "cost",
        f"{IMPLIED_MODELS[axis, value]} compiles its blocks once, on a host of a plain lifecycle and one request at "
        "a time (a killed worker's new group, a restarted server and a batch of two compile them again)",
    )
    for axis, value in IMPLIED_MODELS
    for when in ({"lifecycle": ("killed", "restarted")}, {"batching": ("beside",)})
)
"""The values of :data:`IMPLIED_MODELS` meet ``--compile`` on one host each, which compiles once."""
COST += IMPLIED_COST
RULES = REFUSED + INAPPLICABLE + COST


@dataclass(frozen=True)
class Case:
    values: dict[str, str]
    refused: Rule | None = None
    """Set for a refusal case: the rule whose refusal is the expected outcome."""

    @property
    def id(self) -> str:
        return "-".join(self.values[axis] for axis in AXES)

    def __getattr__(self, axis: str) -> str:
        try:
            return self.values[axis]
        except KeyError:
            raise AttributeError(axis) from None


def _constraint(rule: Rule) -> dict:
    """``rule`` as a covertable constraint: a row must not match it."""
    matches = [{"operator": "in", "left": axis, "values": list(values)} for axis, values in rule.when.items()]
    return {"operator": "not", "condition": {"operator": "and", "conditions": matches}}


SALT = "100"
"""covertable's salt for its hash sorter: which of the many pairwise arrays the cases are. Each is as good a covering
array; they differ in what they cost to run (:func:`cost`): ``python -m tests.compose_axes --pick-salt 150`` names
the cheapest of the salts 0-149 (about 6 minutes). That is ``"100"``: estimated 664 s against 766 s for ``""`` (6
compiled hosts for 8, 3 torchrun server cases for 4). On it a request-parallel2 server after the int8 one once timed
out loading on the same warm group, after forked ranks aborted collecting their caller's garbage in unload: fixed
(ranks freeze what they were born with, hsdp.launch.rank)."""


def _pairwise(salt: str = SALT) -> list[dict[str, str]]:
    """The tiny-wan cases: pairwise over every value that implies no other model."""
    from covertable import make

    factors = {axis: [v for v in values if (axis, v) not in IMPLIED_MODELS] for axis, values in AXES.items()}
    rows = make(factors, constraints=[_constraint(r) for r in RULES], salt=salt)
    return [{axis: row[axis] for axis in AXES} for row in rows]


IMPLIED_SALT = "10"
"""covertable's salt for the cases of the values of :data:`IMPLIED_MODELS` (:func:`_each_choice`): the cheapest of
the salts 0-119 by :func:`cost` (``python -m tests.compose_axes --pick-implied-salt 120``)."""


ALONE: tuple[dict[str, str], ...] = ()
"""Pairs of an implied value run in a case of their own, every other axis at its plainest value: a pair that meets
a known seam (tests/test_compose.py ``KNOWN_SEAMS``) would hide the other values of a case it shared. None now (LTX-2
under Ulysses, the seam this tier found, is refused before loading)."""


def _each_choice(axis: str, value: str, salt: str = IMPLIED_SALT) -> list[dict[str, str]]:
    """The cases of a value that implies its model: every value of every other axis (but the values that imply
    another model) beside it at least once (covertable at strength 1), under the same rules; each pair of
    :data:`ALONE` in a case of its own."""
    from covertable import make

    factors = {
        other: [value] if other == axis else [v for v in values if (other, v) not in IMPLIED_MODELS]
        for other, values in AXES.items()
    }
    alone = [pair for pair in ALONE if pair.get(axis) == value]
    apart = [Rule({a: (v,) for a, v in pair.items()}, "cost", "alone") for pair in alone]
    rows = make(factors, strength=1, constraints=[_constraint(r) for r in RULES + tuple(apart)], salt=salt)
    plain = {a: next(iter(values)) for a, values in AXES.items()}
    return [{a: row[a] for a in AXES} for row in rows] + [{**plain, **pair} for pair in alone]


def _refusal_cases() -> list[Case]:
    """One case per refusal rule: its first pair, every other axis at its first (plainest) value or the rule's
    ``base``. The rule's other pairs meet the same check before loading (one message for the rule)."""
    plain = {axis: next(iter(values)) for axis, values in AXES.items()}
    return [
        Case({**plain, **rule.base, **{axis: values[0] for axis, values in rule.when.items()}}, refused=rule)
        for rule in REFUSED
    ]


def cases(salt: str = SALT) -> list[Case]:
    """The pairwise cases (deterministic: covertable's hash sorter, :data:`SALT`), then one case per refused pair."""
    return [Case(values) for values in _pairwise(salt)] + implied_cases() + _refusal_cases()


def implied_cases(salt: str = IMPLIED_SALT) -> list[Case]:
    """The cases of the values that imply their model (:func:`_each_choice`)."""
    return [Case(values) for axis, value in IMPLIED_MODELS for values in _each_choice(axis, value, salt)]


OPTION_AXES = ("compile", "vae", "offload", "attention", "weights")
"""The axes that set up an engine or a server (beside the layout, and the cache on a server)."""


def host_key(case: Case) -> tuple:
    """What a case runs on: cases with the same key share one engine or server (tests/test_compose.py)."""
    if case.refused:
        return ("refused",)
    model = model_of(case.values)
    options = tuple(case.values[a] for a in OPTION_AXES)
    if case.layout == "torchrun-2-nodes":
        return ("torchrun-generate",) if case.route == "generate" else ("nodes", model, *options)
    if case.route == "generate":
        return ("engine", model, case.layout, *options)
    return ("server", model, case.layout, *options, case.cache)


COST_S = {"compile": 20.0, "host": 3.0, "torchrun start": 15.0, "lifecycle": 4.0, "case": 2.0}
"""Rough seconds (2 CPU cores, inductor's cache warm) of what a case list costs, measured on the tier: compiling the
blocks (once per compiled host, again for a batch of two and after a killed worker or a restart), starting an engine
or a server on the warm group, starting two torchrun agents (at the start and after each kill or restart), a kill
or a restart, and a case's requests and one-process references."""


def cost(case_list: list[Case]) -> float:
    """:data:`COST_S` summed over ``case_list`` run in :func:`host_key` order."""
    hosts: dict[tuple, list[Case]] = {}
    for case in case_list:
        hosts.setdefault(host_key(case), []).append(case)
    compiles = sum(
        1 + any(c.batching == "beside" for c in members) + sum(c.lifecycle != "plain" for c in members)
        for key, members in hosts.items()
        if key[0] in ("engine", "server") and members[0].compile == "on"
    )
    compiles += 2 * any(c.compile == "on" for c in hosts.get(("torchrun-generate",), []))  # one launch, two ranks
    nodes = [c for key, members in hosts.items() if key[0] == "nodes" for c in members]
    starts = (1 + sum(c.lifecycle != "plain" for c in nodes)) if nodes else 0
    return (
        COST_S["compile"] * compiles
        + COST_S["host"] * len(hosts)
        + COST_S["torchrun start"] * starts
        + COST_S["lifecycle"] * sum(c.lifecycle != "plain" for c in case_list)
        + COST_S["case"] * len(case_list)
    )


def pick_salt(count: int) -> str:
    """The salt among ``0 .. count - 1`` whose cases :func:`cost` least (the first of equals)."""
    return min((str(salt) for salt in range(count)), key=lambda salt: (cost(cases(salt)), int(salt)))


def _pair_rule(pair: dict[str, str]) -> Rule | None:
    return next((r for r in REFUSED + INAPPLICABLE if r.decided(pair) and r.matches(pair)), None)


def all_pairs() -> list[dict[str, str]]:
    """Every pair of values of two different axes."""
    return [
        {a: va, b: vb}
        for a, b in itertools.combinations(AXES, 2)
        for va, vb in itertools.product(AXES[a], AXES[b])
    ]


def uncovered_pairs(case_list: list[Case]) -> list[dict[str, str]]:
    """Pairs that no case runs (or, for refused pairs, checks) and that no refused / inapplicable rule explains."""
    missing = []
    for pair in all_pairs():
        rule = _pair_rule(pair)
        if rule is not None and rule.kind == "inapplicable":
            continue
        if rule is not None and any(case.refused is rule for case in case_list):
            continue  # the rule's refusal case checks its message
        if not any(all(case.values[a] == v for a, v in pair.items()) for case in case_list):
            missing.append(pair)
    return missing


def covered_pairs(case_list: list[Case]) -> int:
    return sum(
        1
        for pair in all_pairs()
        if any(all(case.values[a] == v for a, v in pair.items()) for case in case_list)
    )


# -- the generated docs tables ------------------------------------------------------------------------------
DOC = Path(__file__).resolve().parents[1] / "docs" / "compose.md"
BEGIN, END = "<!-- compose-axes: begin (generated by python -m tests.compose_axes --docs) -->", "<!-- compose-axes: end -->"


def _when(rule: Rule) -> str:
    return " with ".join(f"{axis} {' / '.join(values)}" for axis, values in rule.when.items())


def docs_tables() -> str:
    """The axes, the combinations that are refused or do not exist, and the cost rules, as markdown."""
    case_list = cases()
    lines = ["| axis | value | how |", "|---|---|---|"]
    for axis, values in AXES.items():
        lines += [f"| {axis} | `{value}` | {how} |" for value, how in values.items()]
    lines += ["", "| combination | outcome | why / what the refusal says |", "|---|---|---|"]
    for rule in REFUSED:
        says = " ... ".join(f"`{s}`" for s in rule.says)
        lines.append(f"| {_when(rule)} | refused before loading (exit 2 / `ValueError`) | {rule.why}: {says} |")
    for rule in INAPPLICABLE:
        lines.append(f"| {_when(rule)} | does not exist | {rule.why} |")
    lines += ["", "Not run together, to keep the tier cheap (each pair involved is covered by other cases):", ""]
    lines += [f"- {_when(rule)}: {rule.why}" for rule in COST]
    total = len(all_pairs())
    lines += [
        "",
        f"{len(case_list)} cases cover {covered_pairs(case_list)} of the {total} value pairs; every other pair "
        "is one that does not exist (above).",
    ]
    return "\n".join(lines)


def render_doc(text: str) -> str:
    """``text`` (docs/compose.md) with the generated part replaced by :func:`docs_tables`."""
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{docs_tables()}\n{END}{tail}"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--pick-implied-salt"]:
        best = min(map(str, range(int(sys.argv[2]))), key=lambda salt: (cost(implied_cases(salt)), int(salt)))
        print(f"IMPLIED_SALT = {best!r}: {cost(implied_cases(best)):.0f} s ({IMPLIED_SALT!r}: "
              f"{cost(implied_cases()):.0f} s)")
    elif sys.argv[1:2] == ["--pick-salt"]:
        best = pick_salt(int(sys.argv[2]))
        print(f"SALT = {best!r}: {cost(cases(best)):.0f} s (salt {SALT!r}: {cost(cases()):.0f} s)")
    elif sys.argv[1:] == ["--docs"]:
        DOC.write_text(render_doc(DOC.read_text()))
        print(f"wrote {DOC}")
    else:
        for case in cases():
            print(case.id, "(refused)" if case.refused else "")
