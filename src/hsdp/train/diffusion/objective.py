"""The training objective of a diffusers pipeline, read from its own scheduler config.

Flow-matching schedulers (``FlowMatch*``, or any scheduler configured with ``prediction_type="flow_prediction"`` /
``use_flow_sigmas``, as Wan's UniPC is) train on ``x_t = (1 - s) x_0 + s * noise`` with the target
``noise - x_0``; ``s`` is drawn with diffusers' own ``compute_density_for_timestep_sampling`` (uniform, logit-normal
or mode), shifted by the flow shift (``s' = shift * s / (1 + (shift - 1) * s)``, the scheduler's own shift unless
``--flow-shift`` says otherwise), and the loss is weighted with ``compute_loss_weighting_for_sd3``. DDPM-style
schedulers (SDXL's, CogVideoX's) noise with ``DDPMScheduler.add_noise`` on the noise schedule of the pipeline's own
scheduler (CogVideoX shifts it by ``snr_shift_scale``) and predict ``epsilon`` or ``v_prediction`` (the scheduler's
``prediction_type``).

EDM-style schedulers (those with ``precondition_inputs`` / ``precondition_noise`` / ``precondition_outputs``:
``CosineDPMSolverMultistepScheduler``, Stable Audio's, and ``EDMEuler`` / ``EDMDPMSolverMultistep``) noise as
they sample: ``x = x_0 + sigma * noise``, the denoiser taking ``precondition_inputs(x, sigma)`` at the timestep
``precondition_noise(sigma)``. The timestep is drawn over the span the scheduler's ``[sigma_min, sigma_max]`` gives it
(uniform unless ``--timestep-sampling`` says otherwise) and ``sigma`` is its preimage; the target is the output
whose ``precondition_outputs`` is ``x_0`` (for the cosine scheduler's v-prediction with ``sigma_data`` 1, Stable
Audio's ``v = cos(t pi / 2) noise - sin(t pi / 2) x_0`` at input ``cos(t pi / 2) x_0 + sin(t pi / 2) noise``, as
stable-audio-tools trains it), weighted 1.

Every random draw comes from a CPU generator the caller seeds per step and micro-batch, drawn for the whole global
micro-batch, so a run gives the same noise and timesteps at every world size and layout.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Objective", "TIMESTEP_SAMPLING", "objective_for"]

TIMESTEP_SAMPLING = ("uniform", "logit_normal", "mode")


@dataclass(frozen=True)
class Noised:
    """One micro-batch, noised: the denoiser's input and timesteps, the target and the per-row loss weights."""

    noisy: torch.Tensor
    timesteps: torch.Tensor
    target: torch.Tensor
    weights: torch.Tensor


@dataclass(frozen=True)
class Objective:
    kind: str
    """``flow_matching``, ``epsilon``, ``v_prediction`` or ``edm`` (the scheduler's preconditioning)."""
    num_train_timesteps: int = 1000
    shift: float = 1.0
    sampling: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    min_timestep: float = 0.0
    max_timestep: float = 1.0
    """The fraction of the timestep range trained, as the pipeline's timesteps (for flow matching: the sigmas
    after the shift), which Wan 2.2's ``boundary_ratio`` splits between its experts."""
    scheduler_config: dict | None = None

    def noise(self, latents: torch.Tensor, generator: torch.Generator) -> Noised:
        """Noise the global micro-batch ``latents`` (CPU, fp32) with draws from ``generator``."""
        noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32)
        if self.kind in ("flow_matching", "edm"):
            return self._flow(latents, noise, generator)
        return self._ddpm(latents, noise, generator)

    def at(self, latents: torch.Tensor, noise: torch.Tensor, u: torch.Tensor) -> Noised:
        """Noise ``latents`` with ``noise`` at fractions ``u`` (``[B]`` in [0, 1]) of the trained timestep range:
        training draws ``u``, evaluation fixes it (:mod:`hsdp.train.diffusion.evaluation`)."""
        if self.kind == "edm":
            return self._edm_at(latents, noise, u)
        if self.kind != "flow_matching":
            low, high = self._timestep_bounds()
            return self._ddpm_at(latents, noise, (low + u * (high - low)).long().clamp(low, high - 1))
        from diffusers.training_utils import compute_loss_weighting_for_sd3

        low, high = self._unshifted(self.min_timestep), self._unshifted(self.max_timestep)
        u = low + (high - low) * u.float()
        sigmas = self.shift * u / (1 + (self.shift - 1) * u)
        s = sigmas.view(-1, *([1] * (latents.dim() - 1)))
        weights = compute_loss_weighting_for_sd3(weighting_scheme=self.sampling, sigmas=sigmas)
        return Noised(
            noisy=(1 - s) * latents + s * noise,
            timesteps=sigmas * self.num_train_timesteps,
            target=noise - latents,
            weights=weights.float(),
        )

    def _unshifted(self, sigma: float) -> float:
        """The draw the shift takes to ``sigma`` (its inverse: ``u = sigma / (shift - (shift - 1) sigma)``), so that
        the trained sigmas span exactly ``[min_timestep, max_timestep]``; 0 and 1 stay 0 and 1, exactly."""
        return sigma if sigma in (0.0, 1.0) else sigma / (self.shift - (self.shift - 1) * sigma)

    def _flow(self, latents: torch.Tensor, noise: torch.Tensor, generator: torch.Generator) -> Noised:
        from diffusers.training_utils import compute_density_for_timestep_sampling

        u = compute_density_for_timestep_sampling(
            weighting_scheme=self.sampling,
            batch_size=latents.shape[0],
            logit_mean=self.logit_mean,
            logit_std=self.logit_std,
            mode_scale=self.mode_scale,
            generator=generator,
        )
        return self.at(latents, noise, u)

    @functools.cached_property
    def _edm_scheduler(self):
        import diffusers

        config = self.scheduler_config or {}
        return getattr(diffusers, str(config["_class_name"])).from_config(config)

    def _edm_sigma(self, timesteps: torch.Tensor) -> torch.Tensor:
        """The sigmas whose ``precondition_noise`` is ``timesteps`` (float64; bisection: the map is increasing)."""
        scheduler = self._edm_scheduler
        low = torch.full_like(timesteps, float(scheduler.config.sigma_min))
        high = torch.full_like(timesteps, float(scheduler.config.sigma_max))
        for _ in range(100):
            middle = (low + high) / 2
            above = scheduler.precondition_noise(middle).to(timesteps.dtype).view(-1) >= timesteps
            low, high = torch.where(above, low, middle), torch.where(above, middle, high)
        return (low + high) / 2

    def _edm_at(self, latents: torch.Tensor, noise: torch.Tensor, u: torch.Tensor) -> Noised:
        scheduler = self._edm_scheduler
        ends = [float(scheduler.precondition_noise(torch.tensor([float(scheduler.config[k])], dtype=torch.float64)))
                for k in ("sigma_min", "sigma_max")]  # fmt: skip
        low = ends[0] + self.min_timestep * (ends[1] - ends[0])
        high = ends[0] + self.max_timestep * (ends[1] - ends[0])
        timesteps = low + (high - low) * u.double()
        sigma = self._edm_sigma(timesteps).view(-1, *([1] * (latents.dim() - 1)))
        x0, x = latents.double(), latents.double() + sigma * noise.double()
        # precondition_outputs is c_skip * x + c_out * output: the output that gives x_0
        skip = scheduler.precondition_outputs(x, torch.zeros_like(x), sigma)
        scale = scheduler.precondition_outputs(torch.zeros_like(x), torch.ones_like(x), sigma)
        return Noised(
            noisy=scheduler.precondition_inputs(x, sigma).float(),
            timesteps=timesteps.float(),
            target=((x0 - skip) / scale).float(),
            weights=torch.ones(latents.shape[0]),
        )

    def _timestep_bounds(self) -> tuple[int, int]:
        low = int(self.min_timestep * self.num_train_timesteps)
        return low, max(low + 1, int(self.max_timestep * self.num_train_timesteps))

    def _ddpm(self, latents: torch.Tensor, noise: torch.Tensor, generator: torch.Generator) -> Noised:
        low, high = self._timestep_bounds()
        return self._ddpm_at(latents, noise, torch.randint(low, high, (latents.shape[0],), generator=generator))

    @functools.cached_property
    def _ddpm_scheduler(self):
        """DDPM's forward process (``add_noise``, ``get_velocity``) on the noise schedule of the pipeline's own
        scheduler class: CogVideoX's schedulers shift ``alphas_cumprod`` by their ``snr_shift_scale`` (as
        train_cogvideox_lora.py's CogVideoXDPMScheduler does), which a ``DDPMScheduler`` built from the same
        config would ignore."""
        import diffusers

        config = self.scheduler_config or {}
        scheduler = diffusers.DDPMScheduler.from_config(config)
        own = getattr(diffusers, str(config.get("_class_name", "")), None)
        alphas = getattr(own.from_config(config), "alphas_cumprod", None) if hasattr(own, "from_config") else None
        if isinstance(alphas, torch.Tensor) and alphas.shape == scheduler.alphas_cumprod.shape:
            scheduler.alphas_cumprod = alphas.clone()
        return scheduler

    def _ddpm_at(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> Noised:
        scheduler = self._ddpm_scheduler
        noisy = scheduler.add_noise(latents, noise, timesteps)
        target = noise if self.kind == "epsilon" else scheduler.get_velocity(latents, noise, timesteps)
        return Noised(noisy=noisy, timesteps=timesteps, target=target, weights=torch.ones(latents.shape[0]))


def _is_flow(config: dict) -> bool:
    return (
        str(config.get("_class_name", "")).startswith("FlowMatch")
        or config.get("prediction_type") == "flow_prediction"
        or bool(config.get("use_flow_sigmas"))
    )


def _is_edm(config: dict) -> bool:
    """A scheduler that preconditions as EDM does (its own ``precondition_*`` methods, ``sigma_min`` / ``sigma_max``)."""
    import diffusers

    cls = getattr(diffusers, str(config.get("_class_name", "")), None)
    methods = ("precondition_inputs", "precondition_noise", "precondition_outputs")
    return cls is not None and all(hasattr(cls, m) for m in methods) and {"sigma_min", "sigma_max"} <= set(config)


def objective_for(
    pipeline_dir: Path,
    *,
    sampling: str = "uniform",
    shift: float | None = None,
    timestep_range: tuple[float, float] = (0.0, 1.0),
) -> Objective:
    """The objective of the pipeline in ``pipeline_dir`` from ``scheduler/scheduler_config.json``."""
    path = Path(pipeline_dir) / "scheduler" / "scheduler_config.json"
    if not path.is_file():
        raise ValueError(f"--model {pipeline_dir}: no scheduler/scheduler_config.json, so no training objective")
    config = json.loads(path.read_text())
    steps = int(config.get("num_train_timesteps", 1000))
    low, high = timestep_range
    if _is_flow(config):
        own = config.get("flow_shift", config.get("shift", 1.0))
        return Objective(
            "flow_matching",
            num_train_timesteps=steps,
            shift=float(own if shift is None else shift),
            sampling=sampling,
            min_timestep=low,
            max_timestep=high,
        )
    if _is_edm(config):
        return Objective(
            "edm", sampling=sampling, min_timestep=low, max_timestep=high, scheduler_config=config
        )
    prediction = config.get("prediction_type", "epsilon")
    if prediction not in ("epsilon", "v_prediction"):
        raise ValueError(f"--model {pipeline_dir}: scheduler prediction_type {prediction!r} cannot be trained")
    return Objective(
        prediction,
        num_train_timesteps=steps,
        min_timestep=low,
        max_timestep=high,
        scheduler_config=config,
    )
