"""Images certified: a vision-language model's run with an image, against plain transformers.

tl's hooks sit on the language stack, and its attention function also runs in the vision
tower. One prompt holding one image's tokens, with one random image, runs twice: through
plain transformers and through tl's forward with every hook attached. The logits must
agree, and the language stack's first input at the image positions must be the projected
features ``get_image_features`` gives: the image reached the stream tl serves, where it
claims. The driver takes images only while both checks pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from tl_core.certification import CertificationCheck, compare
from tl_driver_hf._architecture._probe import probe_ids
from tl_driver_hf._architecture._vision import image_features, model_pixels

if TYPE_CHECKING:
    from tl_core.architecture import VisionDescription
    from tl_driver_hf._certification._certification_target import CertifiableDriver

__all__ = ["IMAGE_EQUATIONS", "image_checks"]

#: The equations of the image checks, as reports name them.
IMAGE_EQUATIONS = (
    "with an image: logits == the engine's logits",
    "with an image: blocks.0.hook_in at the image positions == the projected image features",
)


def _image_prompt(vision: VisionDescription, vocab: int) -> torch.Tensor:
    assert isinstance(vision.tokens_per_image, int)
    ids = [t if t != vision.image_token_id else t + 1 for t in probe_ids(vocab)[0].tolist()]
    return torch.tensor([ids[:2] + [vision.image_token_id] * vision.tokens_per_image + ids[2:]])


def image_checks(
    driver: CertifiableDriver, vision: VisionDescription, rtol: float
) -> list[CertificationCheck]:
    """The two image checks of ``driver``'s model (they vouch for no hook: a failure stops
    the driver taking images, and leaves the text path as certified)."""
    model = driver.hf_model
    param = next(model.parameters())
    vocab = int(cast(torch.Tensor, driver.hooked_model.parts.embed.weight).shape[0])
    ids = _image_prompt(vision, vocab).to(param.device)
    generator = torch.Generator().manual_seed(0)
    shape = (1, vision.channels, *vision.image_size)
    pixels = torch.randn(shape, generator=generator).to(param.device, param.dtype)
    logits_eq, features_eq = IMAGE_EQUATIONS
    grouped = bool(getattr(driver, "grouped_pixels", False))
    try:
        with torch.no_grad():
            plain = model(
                input_ids=ids, pixel_values=model_pixels(pixels, grouped), use_cache=False
            ).logits
            features = image_features(model, pixels, grouped=grouped)
    except Exception as error:
        detail = f"plain transformers raised {type(error).__name__}: {error}"[:200]
        return [
            CertificationCheck(e, (), False, float("inf"), 0.0, detail) for e in IMAGE_EQUATIONS
        ]
    stream: dict[str, torch.Tensor] = {}

    def keep(x: torch.Tensor, *, hook: object) -> None:
        stream["in"] = x.detach()

    first = driver.hook_points.get("blocks.0.hook_in")
    handle = first.add_hook(keep) if first is not None else None
    try:
        with torch.no_grad():
            ours = driver.run_model(ids, images=pixels)
    except Exception as error:
        detail = f"tl's forward raised {type(error).__name__}: {error}"[:200]
        return [
            CertificationCheck(e, (), False, float("inf"), 0.0, detail) for e in IMAGE_EQUATIONS
        ]
    finally:
        if handle is not None:
            handle.remove()
    checks = [compare(logits_eq, (), ours, plain, rtol=rtol)]
    at_image = ids[0] == vision.image_token_id
    got = stream["in"][0, at_image] if "in" in stream else None
    checks.append(compare(features_eq, (), got, features.to(param.dtype), rtol=rtol))
    return checks
