"""hsdp's diffusion loss against diffusers' own training scripts, and each held-out family learning.

* **Loss formula**: for every family with an official diffusers example training script
  (``examples/dreambooth/train_dreambooth_lora_{flux,sd3,sdxl,sana,lumina2,z_image,qwen_image,hidream}.py``,
  ``examples/cogvideo/train_cogvideox_lora.py``; line numbers at diffusers 58eb52c), hsdp's loss on a fixed batch (the
  same pixels, noise, timesteps / sigmas and caption encodings) equals the script's formula re-expressed here (its
  latent normalization, noising, the denoiser call with its packing and timestep, the target and the loss
  weighting) within 1e-6, on the same denoiser. HiDream's formula encodes the captions itself, as its script does
  (its Llama 3 hidden states are laid out ``[layers, captions, ...]``), so hsdp's cached encodings are checked too.
* **Each family learns**: with the noise and timestep held fixed, 30 AdamW steps of hsdp's trainer (LoRA on every
  linear layer of the denoiser) on one image and caption lower that sample's loss by at least half.

One process, one trainer per family (``DiffusionTrainer``: the captions encoded by the pipeline's ``encode_prompt``
as its ``__call__`` calls them, the latents by hsdp's VAE path), torch on one thread (tiny models; on a loaded
2-core machine several threads make each step ~10x slower).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hsdp.train import TrainConfig
from hsdp.train.diffusion import DiffusionTrainer
from hsdp.train.diffusion.pipeline_call import DenoiserBatch
from hsdp.train.diffusion.trainer import _MicroBatch
from tests.heldout_pipelines import BUILDERS, FORMULA_ONLY, build, write_square_media

pytestmark = pytest.mark.slow
ROWS = 2
OVERFIT_STEPS = 30
OVERFIT_CHECK = 5
"""How often :func:`test_family_overfits_one_sample` reads the fixed sample's loss (a forward: a third of a step)."""


def _linear_names(folder: Path) -> tuple[str, ...]:
    """Every ``nn.Linear`` of the pipeline's first denoiser (LoRA on the attention alone fits one sample of the
    toy SD3 and SANA too slowly: loss x0.79 in 30 steps)."""
    from hsdp.planning.profile import build_meta_model

    component = "unet" if (folder / "unet").is_dir() else "transformer"
    model = build_meta_model(folder / component, torch.float32)[0]
    return tuple(name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear))


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    """``trainers(name)``: (hsdp's one-process trainer, the plain diffusers pipeline) for a held-out family or a
    built-in, made once."""
    import diffusers

    from hsdp.models.builtin import resolve_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("formulas")
    media = root / "media"
    media.mkdir()
    write_square_media(media, count=ROWS)
    made: dict = {}

    def get(name: str, data: Path = media, resolution: int = 32):
        if (name, data) not in made:
            folder = build(name, root) if name in BUILDERS or name in FORMULA_ONLY else resolve_model(name)
            cfg = TrainConfig(model=str(folder), data=str(data), resolution=resolution, steps=OVERFIT_STEPS,
                              batch_size=ROWS, lr=1e-2, seed=3, lora_r=8, lora_alpha=8.0,
                              lora_target_modules=_linear_names(folder), progress=False)  # fmt: skip
            trainer = DiffusionTrainer(cfg)
            pipe = diffusers.DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float32)
            made[name, data] = trainer, pipe
        return made[name, data]

    yield get
    for trainer, _ in made.values():
        trainer.close()
    torch.set_num_threads(threads)


def _micro_batch(trainer, latents: torch.Tensor, noise: torch.Tensor, u: torch.Tensor, items=None) -> _MicroBatch:
    """hsdp's micro-batch of the trainer's first rows (captions: their encodings, or ``items``): its objective
    noises ``latents`` at fractions ``u`` of the timestep range."""
    noised = trainer.objective.at(latents, noise, u)
    bucket = trainer.data.dataset.buckets[0]
    prompts = trainer.batch_prompts(items or trainer.data.prompts[: len(latents)])
    batch = DenoiserBatch(noised.noisy, noised.timesteps, prompts, (bucket.height, bucket.width), bucket.frames)
    return _MicroBatch(batch, noised.target, noised.weights, trainer.component)


# --- the scripts' formulas -----------------------------------------------------------------------------------------
# Each family has two: the script's latents of pixels [B, C, F, H, W] (in the VAE's layout), and its loss given the
# trainer, the pipeline, the denoiser, latents, noise (in the VAE's layout, as hsdp draws it) and the captions'
# encodings as hsdp batches them (``prompt.<call>.<position>`` of encode_prompt's return): (the script's loss, the u
# at which hsdp's objective gives the same timesteps).


def _weighted_mse(pred: torch.Tensor, target: torch.Tensor, weighting: torch.Tensor) -> torch.Tensor:
    """train_dreambooth_lora_flux.py L1838-1842 (sd3 L1839, sana L1449, lumina2 L1434, z_image L1786): the mean over
    each row's elements of weighting * (pred - target)^2, then over rows."""
    return torch.mean((weighting.float() * (pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1).mean()


def _flow_draw(pipe, rows: int, **config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """train_dreambooth_lora_flux.py L1764-1778 (sd3 L1784-1796, sana L1403-1415, lumina2 L1381-1394, z_image
    L1734-1746): u from compute_density_for_timestep_sampling ("none", the default weighting scheme), an index into
    the pipeline's FlowMatchEulerDiscreteScheduler timesteps, its sigma (get_sigmas, L1678), and the weighting
    (L1817) of the same scheme: (timesteps, sigmas [B], weighting [B]). ``config``: what the script overrides in the
    scheduler's config."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, **config)
    u = compute_density_for_timestep_sampling("none", rows, generator=torch.Generator().manual_seed(5))
    timesteps = scheduler.timesteps[(u * scheduler.config.num_train_timesteps).long()]
    sigmas = scheduler.sigmas[[(scheduler.timesteps == t).nonzero().item() for t in timesteps]]
    return timesteps, sigmas, compute_loss_weighting_for_sd3("none", sigmas)


def _hsdp_u(trainer, noise_level: torch.Tensor) -> torch.Tensor:
    """The fraction u whose shifted sigma (hsdp's objective: shift * u / (1 + (shift - 1) * u)) is ``noise_level``."""
    shift, s = trainer.objective.shift, noise_level.double()
    return (s / (shift - (shift - 1) * s)).float()


def _view(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.view(-1, *([1] * (like.dim() - 1)))


def _normalized(vae, pixels: torch.Tensor) -> torch.Tensor:
    """train_dreambooth_lora_flux.py L1746-1748 (sd3 L1773-1776, lumina2 L1369-1372, z_image L1723-1727):
    (latent - shift_factor) * scaling_factor, the posterior's mode for the sample the script draws."""
    latents = vae.encode(pixels[:, :, 0]).latent_dist.mode()
    return (latents - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor


def flux(trainer, pipe, model, x0, noise, prompts):
    from diffusers import FluxPipeline

    rows, channels, height, width = x0.shape
    timesteps, sigmas, weighting = _flow_draw(pipe, rows)
    s = _view(sigmas, x0)
    noisy = (1.0 - s) * x0 + s * noise  # L1779
    packed = FluxPipeline._pack_latents(noisy, rows, channels, height, width)  # L1781
    guidance = torch.tensor([3.5]).expand(rows) if model.config.guidance_embeds else None  # L1790-1794, default 3.5
    image_ids = FluxPipeline._prepare_latent_image_ids(rows, height // 2, width // 2, x0.device, x0.dtype)  # L1752
    pred = model(hidden_states=packed, timestep=timesteps / 1000, guidance=guidance,
                 pooled_projections=prompts["prompt.0.1"], encoder_hidden_states=prompts["prompt.0.0"],
                 txt_ids=torch.zeros(prompts["prompt.0.0"].shape[1], 3), img_ids=image_ids, return_dict=False)[0]  # L1797
    scale = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    pred = FluxPipeline._unpack_latents(pred, height * scale, width * scale, scale)  # L1808
    target = noise - x0  # L1820
    return _weighted_mse(pred, target, _view(weighting, x0)), _hsdp_u(trainer, sigmas)


def sd3(trainer, pipe, model, x0, noise, prompts):
    timesteps, sigmas, weighting = _flow_draw(pipe, len(x0))
    s = _view(sigmas, x0)
    noisy = (1.0 - s) * x0 + s * noise  # L1797
    pred = model(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=prompts["prompt.0.0"],
                 pooled_projections=prompts["prompt.0.2"], return_dict=False)[0]  # L1800-1806
    target = noise - x0  # L1821 (no --precondition_outputs)
    return _weighted_mse(pred, target, _view(weighting, x0)), _hsdp_u(trainer, sigmas)


def _sana_latents(vae, pixels):
    return vae.encode(pixels[:, :, 0]).latent * vae.config.scaling_factor  # L1391-1394 (DC-AE)


def sana(trainer, pipe, model, x0, noise, prompts):
    timesteps, sigmas, weighting = _flow_draw(pipe, len(x0))
    s = _view(sigmas, x0)
    noisy = (1.0 - s) * x0 + s * noise  # L1416
    pred = model(hidden_states=noisy, encoder_hidden_states=prompts["prompt.0.0"],
                 encoder_attention_mask=prompts["prompt.0.1"], timestep=timesteps, return_dict=False)[0]  # L1419-1425
    target = noise - x0  # L1432
    return _weighted_mse(pred, target, _view(weighting, x0)), _hsdp_u(trainer, sigmas)


def lumina2(trainer, pipe, model, x0, noise, prompts):
    timesteps, sigmas, weighting = _flow_draw(pipe, len(x0))
    s = _view(sigmas, x0)
    noisy = (1.0 - s) * noise + s * x0  # L1395: the reversed lerp, sigma 1 is the clean latent
    pred = model(hidden_states=noisy, encoder_hidden_states=prompts["prompt.0.0"],
                 encoder_attention_mask=prompts["prompt.0.1"],
                 timestep=timesteps / pipe.scheduler.config.num_train_timesteps, return_dict=False)[0]  # L1399-1409
    target = x0 - noise  # L1417
    # hsdp noises at sigma' = 1 - sigma (its x_t = (1 - sigma') x0 + sigma' noise) and the pipeline's call turns
    # its timestep into 1 - t / 1000 = sigma and negates the prediction
    return _weighted_mse(pred, target, _view(weighting, x0)), _hsdp_u(trainer, 1 - sigmas)


def z_image(trainer, pipe, model, x0, noise, prompts):
    timesteps, sigmas, weighting = _flow_draw(pipe, len(x0))
    s = _view(sigmas, x0)
    noisy = (1.0 - s) * x0 + s * noise  # L1747
    normalized = (1000 - timesteps) / 1000  # L1749
    inputs = list(noisy.unsqueeze(2).unbind(dim=0))  # L1751-1752
    pred = model(inputs, normalized, prompts["prompt.0.0"], return_dict=False)[0]  # L1754-1759: lists
    pred = -torch.stack(pred, dim=0).squeeze(2)  # L1760-1762: Z-Image negates the prediction
    target = noise - x0  # L1769
    return _weighted_mse(pred, target, _view(weighting, x0)), _hsdp_u(trainer, sigmas)


def _qwen_image_latents(vae, pixels):
    """train_dreambooth_lora_qwen_image.py L1221-1222, L1735-1737: the 3D VAE's latents [B, C, 1, H, W],
    (latent - latents_mean) * (1 / latents_std); no scaling factor."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean, inv_std = torch.tensor(vae.config.latents_mean).view(shape), 1.0 / torch.tensor(vae.config.latents_std).view(shape)
    return (vae.encode(pixels).latent_dist.mode() - mean) * inv_std


def qwen_image(trainer, pipe, model, x0, noise, prompts):
    from diffusers import QwenImagePipeline

    rows, channels, _, height, width = x0.shape
    timesteps, sigmas, weighting = _flow_draw(pipe, rows)  # L1746-1758
    s = _view(sigmas, x0)
    noisy = (1.0 - s) * x0 + s * noise  # L1759
    img_shapes = [(1, height // 2, width // 2)] * rows  # L1764
    packed = QwenImagePipeline._pack_latents(noisy.permute(0, 2, 1, 3, 4), rows, channels, height, width)  # L1766-1773
    # L1774-1781; the captions' mask as encode_prompt gives it (None where every token counts, as here: the
    # script's concat_prompt_embedding_batches makes that all ones)
    pred = model(hidden_states=packed, encoder_hidden_states=prompts["prompt.0.0"],
                 encoder_hidden_states_mask=prompts.get("prompt.0.1"), timestep=timesteps / 1000,
                 img_shapes=img_shapes, return_dict=False)[0]  # fmt: skip
    scale = 2 ** len(pipe.vae.temperal_downsample)  # L1220
    pred = QwenImagePipeline._unpack_latents(pred, height * scale, width * scale, scale)  # L1782-1784
    target = noise - x0  # L1790
    return _weighted_mse(pred, target, _view(weighting, x0)), _hsdp_u(trainer, sigmas)


def hidream(trainer, pipe, model, x0, noise, prompts):
    """train_dreambooth_lora_hidream.py: the latents as the VAE gives them (the transformer patchifies them), the
    captions encoded by the script itself (not hsdp's cache: T5's hidden states, Llama 3's per-layer ones laid out
    ``[layers, B, tokens, width]``, the CLIPs' pooled outputs), the timestep unscaled, the prediction negated."""
    captions = [trainer.data.dataset.items[i].caption for i in range(len(x0))]
    t5, _, llama3, _, pooled, _ = pipe.encode_prompt(prompt=captions, max_sequence_length=128)  # L1346-1355
    timesteps, sigmas, weighting = _flow_draw(pipe, len(x0), shift=3.0)  # L1080-1081, L1590-1602
    s = _view(sigmas, x0)
    noisy = (1.0 - s) * x0 + s * noise  # L1603
    pred = model(hidden_states=noisy, encoder_hidden_states_t5=t5, encoder_hidden_states_llama3=llama3,
                 pooled_embeds=pooled, timesteps=timesteps, return_dict=False)[0]  # L1605-1612
    pred = -pred  # L1613
    target = noise - x0  # L1618
    return _weighted_mse(pred, target, _view(weighting, x0)), _hsdp_u(trainer, sigmas)  # L1616, L1633-1638


def _ddpm_u(timesteps: torch.Tensor) -> torch.Tensor:
    """The u at which hsdp's DDPM objective takes the integer ``timesteps`` (it floors u * 1000)."""
    return (timesteps.float() + 0.5) / 1000


def _sdxl_latents(vae, pixels):
    return vae.encode(pixels[:, :, 0]).latent_dist.mode() * vae.config.scaling_factor  # L1685-1688


def sdxl(trainer, pipe, model, x0, noise, prompts):
    """train_dreambooth_lora_sdxl.py, without --do_edm_style_training and --snr_gamma (its defaults)."""
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler.from_config(pipe.scheduler.config)  # L1128
    timesteps = torch.tensor([300, 700])  # L1703: torch.randint(0, 1000), fixed here
    noisy = scheduler.add_noise(x0, noise, timesteps)  # L1716
    height, width = (side * pipe.vae_scale_factor for side in x0.shape[-2:])
    # L1477-1483 compute_time_ids: original size + crop corner + target size; the batch's bucket, uncropped
    time_ids = torch.tensor([[height, width, 0, 0, height, width]], dtype=torch.float32).repeat(len(x0), 1)
    pred = model(noisy, timesteps, prompts["prompt.0.0"],
                 added_cond_kwargs={"time_ids": time_ids, "text_embeds": prompts["prompt.0.2"]}, return_dict=False)[0]  # L1748
    target = noise if scheduler.config.prediction_type == "epsilon" else scheduler.get_velocity(x0, noise, timesteps)  # L1796-1803
    loss = torch.nn.functional.mse_loss(pred.float(), target.float(), reduction="mean")  # L1835
    return loss, _ddpm_u(timesteps)


def _cogvideox_latents(vae, pixels):
    return vae.encode(pixels).latent_dist.mode() * vae.config.scaling_factor  # L1235-1239, L1279


def cogvideox(trainer, pipe, model, x0, noise, prompts):
    """examples/cogvideo/train_cogvideox_lora.py: the video's latents as [B, F, C, H, W], v-prediction turned into
    a predicted sample and compared with the latents, weighted by 1 / (1 - alphas_cumprod)."""
    from diffusers import CogVideoXDPMScheduler

    scheduler = CogVideoXDPMScheduler.from_config(pipe.scheduler.config)  # L1069
    x0, noise = x0.permute(0, 2, 1, 3, 4), noise.permute(0, 2, 1, 3, 4)  # L1283: [B, F, C, H, W]
    timesteps = torch.tensor([300, 700])  # L1424: torch.randint(0, 1000), fixed here
    noisy = scheduler.add_noise(x0, noise, timesteps)  # L1446
    assert not model.config.use_rotary_positional_embeddings  # L1430-1441 pass None then
    output = model(hidden_states=noisy, encoder_hidden_states=prompts["prompt.0.0"], timestep=timesteps,
                   image_rotary_emb=None, return_dict=False)[0]  # L1449-1455
    pred = scheduler.get_velocity(output, noisy, timesteps)  # L1456
    weights = _view(1 / (1 - scheduler.alphas_cumprod[timesteps]), pred)  # L1458-1461
    target = x0  # L1463
    loss = torch.mean((weights * (pred - target) ** 2).reshape(len(x0), -1), dim=1).mean()  # L1465-1466
    return loss, _ddpm_u(timesteps)


_DREAMBOOTH = "examples/dreambooth/train_dreambooth_lora_{}.py"
SCRIPTS = {"tiny-flux": (_DREAMBOOTH.format("flux"), _normalized, flux),
           "sd3": (_DREAMBOOTH.format("sd3"), _normalized, sd3),
           "tiny-sdxl": (_DREAMBOOTH.format("sdxl"), _sdxl_latents, sdxl),
           "sana": (_DREAMBOOTH.format("sana"), _sana_latents, sana),
           "lumina2": (_DREAMBOOTH.format("lumina2"), _normalized, lumina2),
           "z-image": (_DREAMBOOTH.format("z_image"), _normalized, z_image),
           "qwen-image": (_DREAMBOOTH.format("qwen_image"), _qwen_image_latents, qwen_image),
           "hidream": (_DREAMBOOTH.format("hidream"), _normalized, hidream),
           "cogvideox": ("examples/cogvideo/train_cogvideox_lora.py", _cogvideox_latents, cogvideox)}  # fmt: skip
"""hsdp family -> the diffusers script, its latents and its loss (built-ins tiny-flux and tiny-sdxl; the rest held
out)."""
OVERFIT = [*BUILDERS, "tiny-flux"]
"""Families of the overfit test (not tiny-sdxl: LoRA on its UNet's linear layers, not its convolutions, reaches
x0.53 in 30 steps)."""


@pytest.fixture(scope="module")
def wide_media(tmp_path_factory) -> Path:
    """Two captioned 48 x 32 images: a non-square bucket at their own size (no smaller than ``--resolution``'s area)."""
    import numpy as np
    from PIL import Image

    folder = tmp_path_factory.mktemp("wide")
    rng = np.random.default_rng(2)
    for i in range(ROWS):
        Image.fromarray(rng.integers(0, 255, (32, 48, 3), dtype=np.uint8)).save(folder / f"wide{i}.png")
        (folder / f"wide{i}.txt").write_text(f"a wide picture {i}")
    return folder


@pytest.mark.parametrize("family", [*SCRIPTS, "hidream-wide"])
def test_loss_equals_training_script_formula(family, trainers, wide_media):
    """``hidream-wide``: a 48 x 32 bucket, which HiDream's pipeline rescales to its default area and patchifies
    itself (a non-square size): recorded at the bucket's own size, as the script trains at the data's size."""
    trainer, pipe = trainers("hidream", wide_media, 256) if family == "hidream-wide" else trainers(family)
    bucket = trainer.data.dataset.buckets[0]
    assert (bucket.height, bucket.width) == ((32, 48) if family == "hidream-wide" else (32, 32))
    family = family.removesuffix("-wide")
    pixels = torch.stack([trainer.data.dataset.pixels(i) for i in range(ROWS)])
    latents = torch.stack(trainer.data.latents[:ROWS])
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(0))
    prompts = trainer.batch_prompts(trainer.data.prompts[:ROWS])
    _, script_latents, script_loss = SCRIPTS[family]
    with torch.no_grad():
        # the script's normalization is hsdp's (the VAE's fp32 rounding apart: it encodes a batch, hsdp an item)
        assert (script_latents(pipe.vae, pixels) - latents).abs().max() <= 1e-5 * latents.abs().max()
        want, u = script_loss(trainer, pipe, trainer.model, latents, noise, prompts)
        got = trainer._micro_loss(_micro_batch(trainer, latents, noise, u))
    assert math.isfinite(want.item()) and want.item() > 0.1
    assert abs(got.item() - want.item()) < 1e-6, (got.item(), want.item())


def test_qwen_image_captions_of_different_lengths_masked_as_the_script_masks_them(trainers):
    """Qwen-Image's ``encode_prompt`` returns a mask only for captions of different lengths (None when every token
    counts), so no item's cached encoding has one: a batch of a shorter and a longer caption is zero-padded and
    masked as the script's ``concat_prompt_embedding_batches`` (L1051-1075) pads and masks it, and hsdp's loss equals
    the script's formula (unmasked, the padding would be attended: another loss)."""
    trainer, pipe = trainers("qwen-image")
    items = [dict(p) for p in trainer.data.prompts[:ROWS]]
    items[0]["prompt.0.0"] = items[0]["prompt.0.0"][: len(items[0]["prompt.0.0"]) // 2]  # a caption half as long
    embeds = [i["prompt.0.0"] for i in items]
    length = max(len(e) for e in embeds)
    padded = torch.stack([torch.nn.functional.pad(e, (0, 0, 0, length - len(e))) for e in embeds])
    mask = torch.stack([(torch.arange(length) < len(e)).long() for e in embeds])
    latents = torch.stack(trainer.data.latents[:ROWS])
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, u = qwen_image(trainer, pipe, trainer.model, latents, noise, {"prompt.0.0": padded, "prompt.0.1": mask})
        unmasked, _ = qwen_image(trainer, pipe, trainer.model, latents, noise, {"prompt.0.0": padded})
        got = trainer._micro_loss(_micro_batch(trainer, latents, noise, u, items))
    assert abs(unmasked.item() - want.item()) > 10 * 1e-6, (unmasked.item(), want.item())  # the check can fail
    assert abs(got.item() - want.item()) < 1e-6, (got.item(), want.item())


def test_denoiser_output_in_another_layout_in_training_refused(trainers):
    """HiDream's transformer built without ``force_inference_output`` (which its family file sets, as its script
    does) returns its training-mode prediction patchified, ``[B, C, tokens, patch²]``: the same number of elements
    as the latents, so only the shapes tell. The trainer refuses it rather than train on scrambled elements."""
    trainer, _ = trainers("hidream")
    latents = torch.stack(trainer.data.latents[:ROWS])
    batch = _micro_batch(trainer, latents, torch.zeros_like(latents), torch.tensor([0.5] * ROWS))
    trainer.model.register_to_config(force_inference_output=False)
    try:
        with torch.no_grad(), pytest.raises(ValueError, match=r"returns tensors of shapes \[\(2, 4, 64, 4\)\]"):
            trainer._micro_loss(batch)
    finally:
        trainer.model.register_to_config(force_inference_output=True)


@pytest.mark.parametrize("family", OVERFIT)
def test_family_overfits_one_sample(family, trainers):
    """At most 30 steps with the noise and timestep held fixed (u = 0.5 of the trained range) halve the sample's
    loss: read every :data:`OVERFIT_CHECK` steps, the run stops once it is halved (the claim is the same; most
    families halve it well before step 30)."""
    trainer, _ = trainers(family)
    latents = trainer.data.latents[0][None]
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(0))
    fixed = _micro_batch(trainer, latents, noise, torch.tensor([0.5]))
    trainer._micro_inputs = lambda number: fixed
    first = trainer.train_step().loss
    for step in range(2, OVERFIT_STEPS + 1):
        trainer.train_step()
        if step % OVERFIT_CHECK == 0 or step == OVERFIT_STEPS:
            with torch.no_grad():
                last = trainer._micro_loss(fixed).item()
            if last <= 0.5 * first:
                break
    assert last <= 0.5 * first, (first, last, step)

