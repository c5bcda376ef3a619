"""ParallelConfig rules: no process group needed."""

import pytest

from hsdp.config import ConfigError, ParallelConfig, ShardingStrategy


def resolved(**kwargs) -> ParallelConfig:
    return ParallelConfig(**kwargs).resolved()


def test_single_process_default():
    config = resolved()
    assert config.world_size == 1 and not config.use_hsdp


def test_standalone_hsdp_sizes_and_default_strategy():
    config = resolved(use_hsdp=True, hsdp_shard_size=4)
    assert config.world_size == 4
    assert config.sharding_strategy is ShardingStrategy.FULL_SHARD
    assert config.reshard_after_forward is True
    hybrid = resolved(use_hsdp=True, hsdp_shard_size=2, hsdp_replicate_size=2)
    assert hybrid.world_size == 4 and hybrid.sharding_strategy is ShardingStrategy.HYBRID_SHARD


def test_combined_mode_resolves_auto_shard_size():
    config = resolved(use_hsdp=True, ulysses_degree=2, cfg_parallel_size=2)
    assert config.hsdp_shard_size == 4 and config.world_size == 4
    config = resolved(use_hsdp=True, ulysses_degree=4, hsdp_replicate_size=2)
    assert config.hsdp_shard_size == 2 and config.world_size == 4


def test_tensor_parallel_multiplies_world():
    config = resolved(use_hsdp=True, hsdp_shard_size=2, tensor_parallel_size=2)
    assert config.world_size == 4 and config.data_parallel_size == 2


def test_shard_grad_op_keeps_params_gathered():
    config = resolved(use_hsdp=True, hsdp_shard_size=2, sharding_strategy="shard_grad_op")
    assert config.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP
    assert config.reshard_after_forward is False


def test_mixed_precision_reduces_in_fp32_by_default():
    config = resolved(use_hsdp=True, hsdp_shard_size=2, param_dtype="bf16")
    assert config.reduce_dtype == "fp32"


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(use_hsdp=True), "needs an explicit --hsdp-shard-size"),
        (dict(use_hsdp=True, hsdp_shard_size=0), "--hsdp-shard-size=0 must be >= 1"),
        (dict(use_hsdp=True, ulysses_degree=4, hsdp_shard_size=3), "set --hsdp-shard-size=4"),
        (dict(use_hsdp=True, ulysses_degree=4, hsdp_replicate_size=3), "does not divide"),
        (dict(hsdp_shard_size=2), "no effect without --use-hsdp"),
        (dict(cfg_parallel_size=3), "use 1 or 2"),
        (dict(param_dtype="fp8"), "--param-dtype='fp8' is not a dtype"),
        (dict(use_hsdp=True, hsdp_shard_size=2, sharding_strategy="HYBRID_SHARD"), "HYBRID_SHARD needs"),
        (dict(use_hsdp=True, hsdp_shard_size=2, sharding_strategy="NO_SHARD"), "--hsdp-shard-size 1"),
        (
            dict(use_hsdp=True, hsdp_shard_size=2, hsdp_replicate_size=2, sharding_strategy="FULL_SHARD"),
            "use HYBRID_SHARD",
        ),
        (dict(use_hsdp=True, ulysses_degree=2, tensor_parallel_size=2), "not supported"),
        (dict(use_hsdp=True, ulysses_degree=2, request_parallel=True), "--request-parallel needs standalone"),
        (dict(sharding_strategy="ZERO_4"), "is unknown"),
        (dict(tensor_parallel_size=2), "--tensor-parallel-size=2 is applied only with sharding on"),
        (dict(cpu_offload=True), "--cpu-offload=True has no effect without --use-hsdp"),
        (dict(param_dtype="bf16"), "--param-dtype=bf16 has no effect without --use-hsdp"),
        (dict(reduce_dtype="fp32"), "--reduce-dtype=fp32 has no effect without --use-hsdp"),
        (dict(reshard_after_forward=False), "--reshard-after-forward=False has no effect"),
        (dict(frozen_whole=True), "--frozen-whole=True has no effect without --use-hsdp"),
        (
            dict(use_hsdp=True, hsdp_shard_size=2, frozen_whole=True, cpu_offload=True),
            "--frozen-whole keeps the frozen weights on the device, --cpu-offload in host memory",
        ),
        (dict(ulysses_degree=2, param_dtype="bf16"), "add --use-hsdp (HSDP then overlays the 2"),
        (dict(offload_layers=2), "--offload-layers=2 has no effect without --use-hsdp"),
        (dict(use_hsdp=True, hsdp_shard_size=2, offload_layers=-1), "--offload-layers=-1 must be an integer >= 0"),
        (
            dict(use_hsdp=True, hsdp_shard_size=2, offload_layers=2, cpu_offload=True),
            "--offload-layers 2 keeps the first 2 blocks on the device and offloads the rest, but --cpu-offload",
        ),
        (
            dict(use_hsdp=True, hsdp_shard_size=2, offload_layers=0, frozen_whole=True),
            "--frozen-whole keeps the frozen weights whole on the device: drop one",
        ),
    ],
)
def test_bad_configs_name_the_flag_and_fix(kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**kwargs).resolved()
    assert fragment in str(info.value)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as info:
        ParallelConfig(ulysses_degree=0, ring_degree=-2, param_dtype="x").resolved()
    assert len(info.value.problems) == 3


def test_sharding_only_settings_are_refused_together_without_hsdp():
    """Tensor parallel, offload and mixed precision are applied only when sharding: never ignored silently."""
    settings = dict(tensor_parallel_size=2, cpu_offload=True, param_dtype="bf16")
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**settings).resolved()
    assert len(info.value.problems) == 3
    assert all("--use-hsdp" in problem for problem in info.value.problems)
    config = resolved(use_hsdp=True, hsdp_shard_size=1, **settings)
    assert config.world_size == 2 and config.cpu_offload and config.param_dtype == "bf16"


def test_world_size_needs_resolution():
    with pytest.raises(RuntimeError, match="resolved"):
        _ = ParallelConfig(use_hsdp=True, hsdp_shard_size=2).world_size


def test_replace_of_resolved_config_is_validated_again():
    import dataclasses

    config = resolved(use_hsdp=True, hsdp_shard_size=2)
    with pytest.raises(ConfigError, match="HYBRID_SHARD needs"):
        dataclasses.replace(config, sharding_strategy=ShardingStrategy.HYBRID_SHARD).resolved()
