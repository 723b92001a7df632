"""The sides `kstep bench compare` can run (the diffusion model's samplers, AR): plain Python, so the
CLI lists them without importing torch."""
from dataclasses import dataclass

from kstep.params import AUTOREGRESSIVE, BLOCK_DIFFUSION, DIFFUSION, UNIFORM_DIFFUSION


@dataclass(frozen=True, slots=True)
class Side:
    name: str
    kind: str            # the family kind the side runs on (the diffusion model's, or autoregressive)
    settings: dict

    @property
    def is_diffusion(self) -> bool:
        return self.kind != AUTOREGRESSIVE


SIDES = {
    "diffusion exact": Side("diffusion exact", DIFFUSION, {"exact": True}),
    # the exact sampler's tokens in fewer passes, each pass verifying up to 4 drafted canvases
    "diffusion exact+self": Side("diffusion exact+self", DIFFUSION, {"draft": "self", "num_draft_tokens": 4}),
    "diffusion dual+threshold": Side("diffusion dual+threshold", DIFFUSION, {"cache": "dual", "threshold": 0.9}),
    "diffusion dual K=N/4": Side("diffusion dual K=N/4", DIFFUSION, {"cache": "dual", "steps_per_token": 0.25}),
    # a block-diffusion model: its own block size, the exact cache of finished blocks; threshold is
    # the checkpoint's default decoding (its generation_config.json threshold and sub-block, else 0.9)
    "block exact": Side("block exact", BLOCK_DIFFUSION, {"exact": True}),
    "block exact+self": Side("block exact+self", BLOCK_DIFFUSION, {"draft": "self", "num_draft_tokens": 4}),
    "block threshold": Side("block threshold", BLOCK_DIFFUSION, {}),
    # a uniform-diffusion model (DiffusionGemma): its stopping rule (passes per canvas data-dependent), and
    # vLLM's benchmark setting (16 passes per canvas, never stopping early)
    "uniform adaptive": Side("uniform adaptive", UNIFORM_DIFFUSION, {}),
    "uniform K=16": Side("uniform K=16", UNIFORM_DIFFUSION, {"max_denoising_steps": 16, "confidence_threshold": 0.0}),
    "ar": Side("ar", AUTOREGRESSIVE, {}),
}
