"""Known third-party warnings that hsdp's own use raises every run are filtered by exact message and issuing module
(issue 34): each is raised here through the library's own code where that is cheap, and a neighbour from the same
module (another message, another class) still shows, so no filter is a blanket one."""

from __future__ import annotations

import inspect
import logging
import warnings

import pytest

from hsdp.logging_utils import KNOWN_WARNINGS, quiet_known_warnings

pytestmark = pytest.mark.unit


@pytest.fixture
def quiet():
    """:func:`quiet_known_warnings` applied for the test, the process's filters restored after it."""
    source = logging.getLogger("transformers.utils.import_utils")
    saved = list(source.filters)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        quiet_known_warnings()
        yield shown
    source.filters[:] = saved


def _messages(shown) -> list[str]:
    return [str(w.message) for w in shown]


def test_torchsde_clamp_past_t1_is_quiet_and_before_t0_is_not(quiet):
    import torch
    from torchsde import BrownianInterval

    interval = BrownianInterval(t0=0.0, t1=1.0, size=(1,), dtype=torch.float64)
    interval(0.5, 1.0 + 1e-7)  # diffusers' last step: a rounding error past t1
    assert not [m for m in _messages(quiet) if "tb<=t1" in m], _messages(quiet)
    interval(-0.5, 0.5)
    assert any("Should have ta>=t0" in m for m in _messages(quiet)), _messages(quiet)


def test_peft_second_adapter_notice_is_quiet(quiet):
    from peft import LoraConfig, inject_adapter_in_model
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4))
    for name in ("a", "b"):
        inject_adapter_in_model(LoraConfig(r=2, target_modules=["0"]), model, adapter_name=name)
    assert not [m for m in _messages(quiet) if "Make sure to know what you are doing" in m], _messages(quiet)
    warnings.warn_explicit("another peft warning", UserWarning, "tuners_utils.py", 1, module="peft.tuners.tuners_utils")
    assert "another peft warning" in _messages(quiet)


def test_fsdp_view_notice_is_quiet_for_chroma_only(quiet):
    from torch.distributed.fsdp._fully_shard import _fsdp_state

    assert "returned a view tensor" in inspect.getsource(_fsdp_state)  # the message filtered is torch's own
    module = "torch.distributed.fsdp._fully_shard._fsdp_state"
    for cls in ("FSDPChromaTransformer2DModel", "FSDPLinear"):
        text = f"FSDP2-wrapped module ({cls}) returned a view tensor. An in-place op on this view ..."
        warnings.warn_explicit(text, UserWarning, "_fsdp_state.py", 331, module=module)
    assert [m for m in _messages(quiet) if "returned a view" in m] == [
        "FSDP2-wrapped module (FSDPLinear) returned a view tensor. An in-place op on this view ..."
    ]


def test_transformers_torchvision_fallback_record_is_quiet(quiet):
    from transformers.utils import import_utils

    assert "requires torchvision (not installed); falling back to" in inspect.getsource(import_utils)
    source = logging.getLogger("transformers.utils.import_utils")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    source.addHandler(handler)
    try:
        source.warning(
            "`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil` "
            "for backward compatibility. Install torchvision to use the default backend, ..."
        )
        source.warning("`CLIPImageProcessor` requires torchvision for something else")
    finally:
        source.removeHandler(handler)
    assert seen == ["`CLIPImageProcessor` requires torchvision for something else"]


def test_every_filter_names_its_module_and_why():
    for message, module, why in KNOWN_WARNINGS:
        assert message and "\\." in module and len(why) > 40, (message, module)
