"""``image_features``: a VLM's frozen image encoder run once at stage one (Gemma 3's SigLIP vision
tower + multimodal projector), so training needs no pixels, no vision tower and no image decode.

For each image of a sample, as Gemma 3 computes it on the fly (``transformers``
``Gemma3Model.get_image_features``, which TheWorld calls in ``python/theworld/modeling/gemma_vision.py``)::

    decoded RGB image (its own size, ``image_rgb``)
      -> Gemma3Processor's image processor, its own two steps run where they cost least:
         its resize to the tower's image_size (bilinear, antialiased; uint8) in the decode workers
         (:class:`ProcessorResize`, the producer's ``image_input``), then on the encoder's device its
         fused rescale + normalise ((x - 255 mean) / (255 std))  pixel_values (3, S, S) float32
      -> vision_tower (SigLIP) -> multi_modal_projector (avg-pool to mm_tokens_per_image, RMSNorm,
         matmul)                                              (mm_tokens_per_image, hidden)
      -> bfloat16 (the model's compute dtype; ``dtype`` option)  stored as its int16 bit patterns

so ``image_features`` is ``(n_images, mm_tokens_per_image, text hidden)`` (kind
:class:`shards.kinds.BFloat16Bits`: exact bfloat16 on the device). The job's text must then hold
Gemma's expanded image sequence (``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` x
``<image_soft_token>`` + ``<end_of_image>\\n\\n`` per image, what ``Gemma3Processor`` builds): the
producer gives it as :attr:`ImageFeaturesProducer.image_sequence` and the stage-one job renders
conversations with it (:class:`precompute.chat.ChatTokens`), so feature ``t`` of image ``k`` is the
``t``-th ``<image_soft_token>`` of image ``k``'s run in ``input_ids``.

**Pan-and-scan is refused.** With ``do_pan_and_scan`` on, Gemma 3's image processor returns, per
image, the image and ``num_crops`` crops (``pixel_values`` of ``n_images + sum(num_crops)`` rows) and
its processor rewrites each image's text to hold ``1 + num_crops`` image sequences; features paired
with images by position would give later images the crops of earlier ones. A checkpoint whose
image processor has it on is refused when the encoder loads, before any image is encoded
(``ValueError`` naming ``do_pan_and_scan``: set it false in the checkpoint's processor config), and
:meth:`Gemma3VisionEncoder.pixel_values` refuses any call where the processor's own ``num_crops``
are not all zero.

Only the vision tower and projector stay in memory: the language model of the checkpoint is
dropped right after loading (``from_pretrained`` still reads the whole checkpoint once).
Configured by ``image_features: {name: gemma3, pretrained: DIR_OR_HUB_ID, dtype: bfloat16}`` in the
precompute config (registered here as producer ``image_features`` for ``add-field`` too; a cache
whose ``input_ids`` were rendered without the expanded sequence cannot use features added later:
the recipe finds a different number of image tokens and refuses it).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shardcache.weights import GEMMA3_VISION, checkpoint_sha256, identity, under

from ..effects import BYTES, IDENTITY, SPEC
from ..encoders.batching import BatchPolicy
from ..encoders.capabilities import Capabilities, Declares, Pending
from ..faults import reraise_infrastructure
from ..transfer import to_device, to_host
from .base import ImageTokens, Producer, Timer, submit_each


class ProcessorResize:
    """The resize step of a transformers image processor, what ``processor(images=...)`` runs first, by
    its own ``resize`` (its torchvision backend's, or its PIL backend's): uint8 ``(H, W, 3)`` -> uint8
    ``(3, S, S)``. Picklable; run in the decode workers (``Prepared.model_images``), so the main
    process never resizes an image. :func:`normalize` is the processor's next step, on the device."""

    def __init__(self, image_processor: Any):
        from transformers.image_processing_backends import TorchvisionBackend
        from transformers.image_utils import SizeDict
        self.image_processor = image_processor
        self.torchvision = isinstance(image_processor, TorchvisionBackend)
        size = image_processor.size  # a SizeDict (transformers 5) or its dict
        self.size = size if isinstance(size, SizeDict) else SizeDict(**size)

    def __call__(self, image: np.ndarray) -> np.ndarray:
        ip = self.image_processor
        if ip.do_pan_and_scan:  # (refused when the encoder loads; also if set on since)
            raise ValueError("the image processor has do_pan_and_scan on (crops per image): set it false")
        chw = np.ascontiguousarray(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))
        if self.torchvision:
            import torch
            return ip.resize(image=torch.from_numpy(chw)[None], size=self.size, resample=ip.resample)[0].numpy()
        return np.asarray(ip.resize(image=chw, size=self.size, resample=ip.resample), dtype=np.uint8)


def normalize(image_processor: Any, x):
    """The image processor's rescale and normalise of resized uint8 images ``x`` ``(N, 3, S, S)`` (a torch
    tensor, on the encoder's device) -> float32 ``pixel_values``, in the processor's own arithmetic: its
    torchvision backend's fused ``(x - 255 mean) / (255 std)`` (its own ``rescale_and_normalize``), or its
    PIL backend's ``x`` in float64 times ``rescale_factor``, cast to float32, then ``(x - mean) / std``."""
    import torch
    from transformers.image_processing_backends import TorchvisionBackend
    ip = image_processor
    if isinstance(ip, TorchvisionBackend):
        return ip.rescale_and_normalize(x, ip.do_rescale, ip.rescale_factor, ip.do_normalize, ip.image_mean, ip.image_std)
    x = (x.to(torch.float64) * ip.rescale_factor).to(torch.float32) if ip.do_rescale else x.to(torch.float32)
    if ip.do_normalize:
        mean = torch.tensor(ip.image_mean, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
        std = torch.tensor(ip.image_std, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
        x = (x - mean) / std
    return x


class Gemma3VisionEncoder(Declares):
    """Gemma 3's image path up to the LM's inputs: ``Gemma3Processor``'s image processor, the
    SigLIP ``vision_tower`` and ``multi_modal_projector`` of a ``Gemma3ForConditionalGeneration``
    checkpoint (e.g. ``google/gemma-3-4b-it``).

    Attributes: ``processor`` (the ``Gemma3Processor``), ``image_sequence`` (its
    ``full_image_sequence``), ``boi_token`` / ``image_token`` / ``eoi_token`` (strings),
    ``tokens_per_image``, ``hidden_size`` (the text model's), ``dtype``, ``device``.
    """

    #: spec options besides name and pretrained
    OPTIONS = ("dtype", "revision")
    #: what each option does to a cache (:class:`precompute.effects.Effect`); ``revision`` (the hub revision of
    #: ``pretrained``) picks the files that load (the tower's tensors and the processor config are the identity)
    OPTION_EFFECTS = {"dtype": BYTES, "revision": IDENTITY}

    def __init__(self, pretrained: str, device: str = "cpu", dtype: str = "bfloat16", revision: str | None = None):
        import torch
        from transformers import AutoProcessor, Gemma3ForConditionalGeneration

        from shardcache.pretrained import resolve_pretrained

        from ..encoders._common import resolve_dtype

        self.pretrained = resolve_pretrained(pretrained, what="image_features.pretrained")
        self.revision = revision or None   #: the hub revision of ``pretrained`` (None: main)
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        # its identity first (the tower's tensors in the files transformers opens): what cannot be read is
        # refused before any weight loads (shardcache.weights.CheckpointUnreadable; LocalRevision)
        checkpoint_sha256(self.pretrained, select=under(*GEMMA3_VISION), revision=self.revision,
                          what="image_features.revision")
        self.processor = AutoProcessor.from_pretrained(self.pretrained, revision=self.revision)
        if self.processor.image_processor.do_pan_and_scan:
            raise ValueError(f"image_features.pretrained: {self.pretrained}'s image processor has do_pan_and_scan: "
                             "true (crops per image, text rewritten per crop), which stage one does not support: set "
                             "do_pan_and_scan to false in its processor config (processor_config.json / "
                             "preprocessor_config.json)")
        model = Gemma3ForConditionalGeneration.from_pretrained(self.pretrained, dtype=self.dtype,
                                                               revision=self.revision)
        self.config = model.config
        self.vision_tower = model.model.vision_tower.to(self.device).eval()
        self.projector = model.model.multi_modal_projector.to(self.device).eval()
        del model  # the language model is not needed at stage one
        tok = self.processor.tokenizer
        self.boi_token, self.image_token, self.eoi_token = tok.boi_token, tok.image_token, tok.eoi_token
        self.image_sequence = self.processor.full_image_sequence
        self.tokens_per_image = int(self.config.mm_tokens_per_image)
        self.hidden_size = int(self.config.text_config.hidden_size)
        for p in list(self.vision_tower.parameters()) + list(self.projector.parameters()):
            p.requires_grad_(False)

    @property
    def capabilities(self) -> Capabilities:
        """On its device, asynchronous (:meth:`submit`), every image of a batch in one call."""
        return Capabilities(device=str(self.device), batching=BatchPolicy(1 << 16), asynchronous=True,
                            posterior="image features have no posterior")

    @property
    def image_input(self) -> ProcessorResize:
        """Its processor's resize (:class:`ProcessorResize`), run in the decode workers."""
        return ProcessorResize(self.processor.image_processor)

    def pixel_values(self, images: list[np.ndarray]):
        """uint8 ``(H, W, 3)`` images (any sizes) -> ``pixel_values`` float32 ``(N, 3, S, S)``,
        exactly as ``Gemma3Processor(images=...)`` makes them, one row per image. Raises ``ValueError``
        when the processor made pan-and-scan crops (its ``num_crops`` not all zero). (The job splits
        these steps: :meth:`submit`.)"""
        from PIL import Image
        out = self.processor.image_processor([Image.fromarray(np.asarray(a, dtype=np.uint8)) for a in images],
                                             return_tensors="pt")
        crops = [int(c) for c in out["num_crops"]]
        if any(crops) or out["pixel_values"].shape[0] != len(images):
            raise ValueError(f"the image processor made pan-and-scan crops (num_crops {crops} for {len(images)} "
                             f"images, {out['pixel_values'].shape[0]} pixel_values rows): set do_pan_and_scan to false")
        return out["pixel_values"]

    def features(self, pixel_values):
        """``pixel_values`` ``(N, 3, S, S)`` -> bfloat16 (the encoder dtype) ``(N, tokens_per_image,
        hidden)``: ``multi_modal_projector(vision_tower(pixel_values).last_hidden_state)``, as
        ``Gemma3Model.get_image_features`` computes its ``pooler_output``."""
        import torch
        with torch.inference_mode():
            x = pixel_values.to(self.device, self.dtype)
            h = self.vision_tower(pixel_values=x).last_hidden_state
            return self.projector(h)

    def encode(self, images: list[np.ndarray]) -> list[np.ndarray]:
        """One int16 ``(tokens_per_image, hidden)`` array of bfloat16 bits per uint8 ``(H, W, 3)`` image: the
        processor in one call (:meth:`pixel_values`, which refuses pan-and-scan crops), the tower, the projector.
        (The job splits the processor: :attr:`image_input` in the decode workers, then :meth:`submit`.)"""
        from shards.kinds import BFloat16Bits
        return list(BFloat16Bits.to_storage(self.features(self.pixel_values(images))))

    def submit(self, resized: list[np.ndarray]) -> Pending:
        """Queue the features of images already resized by :attr:`image_input` (uint8 ``(3, S, S)``): the
        processor's rescale + normalise on the device, the tower, the projector, the bfloat16 bits as
        int16 copied into pinned memory without blocking; ``result()``: one int16 ``(tokens_per_image,
        hidden)`` array per image."""
        import torch
        with torch.inference_mode():
            x = to_device(np.stack([np.asarray(a, dtype=np.uint8) for a in resized]), self.device)
            pixel_values = normalize(self.processor.image_processor, x)
            bits = to_host(self.features(pixel_values).to(torch.bfloat16).contiguous().view(torch.int16))
        wait = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            wait = event.synchronize
        return Pending(lambda: list(bits.numpy()), wait)

    def describe(self) -> dict[str, Any]:
        """``class``, ``name``, ``config``, ``dtype``, ``weights_sha256`` (the loaded tower's and projector's),
        ``image_processor`` (the processor as loaded), ``pixel_options`` (its config file's options that shape
        the pixel values, :data:`shardcache.pretrained.GEMMA3_PIXEL_OPTIONS`: what the ``theworld`` recipe
        compares with its checkpoint's), ``image_sequence``, and the identity of the tower and projector as
        stored in the checkpoint (:func:`shardcache.weights.identity`: ``checkpoint_sha256``, ``numerics``,
        ``loaded_from``)."""
        from shardcache.pretrained import GEMMA3_PIXEL_OPTIONS, image_processor_options

        from ..encoders._common import clean_config, state_dict_sha256
        ip = self.processor.image_processor
        return {"class": f"{type(self).__module__}.{type(self).__qualname__}", "name": "gemma3",
                "config": clean_config(self.config), "dtype": str(self.dtype).replace("torch.", ""),
                "weights_sha256": state_dict_sha256(self.vision_tower) + ":" + state_dict_sha256(self.projector),
                "image_processor": ip.to_dict(),
                "pixel_options": image_processor_options(self.pretrained, GEMMA3_PIXEL_OPTIONS, revision=self.revision),
                "image_sequence": self.image_sequence,
                # the tower and projector as stored in the checkpoint: what the theworld recipe compares
                **identity(self.pretrained, dtype=self.dtype, device=self.device, select=under(*GEMMA3_VISION),
                           revision=self.revision)}


#: ``image_features.name`` -> the encoder class
VISION_ENCODERS = {"gemma3": Gemma3VisionEncoder}


def image_features_problems(field: str = "image_features", image_rgb: Any = "composite", producer: str = "",
                            **spec: Any) -> list[tuple[str, str]]:
    """What keeps an ``image_features`` spec ``{name: gemma3, pretrained: DIR_OR_HUB_ID, revision, dtype, image_rgb}``
    from working, as ``(key suffix, message)``. The one owner of these rules: the config check lists them
    (the ``image_features`` option, ``extra_fields``' producer ``image_features``) before any model loads,
    :func:`load_vision_encoder` raises the first. A plug-in image encoder is a producer of its own."""
    from ..encoders._common import ENCODER_DTYPES
    from ..encoders.registry import spec_problems
    from shards.pixels import RGB_MODES
    if "factory" in spec:
        return [("", "a plug-in image encoder is a producer: extra_fields: {NAME: {factory: ...}}")]
    out, p, dtype = spec_problems(spec, VISION_ENCODERS, "gemma3"), spec.get("pretrained"), \
        spec.get("dtype", "bfloat16")
    if not isinstance(p, str) or not p.strip():
        out.append((".pretrained", f"expected a local directory or hub id (e.g. google/gemma-3-4b-it), got {p!r}"))
    if dtype not in ENCODER_DTYPES:
        out.append((".dtype", f"expected one of {', '.join(ENCODER_DTYPES)}, got {dtype!r}"))
    if image_rgb not in RGB_MODES:
        out.append((".image_rgb", f"expected one of {', '.join(RGB_MODES)}, got {image_rgb!r}"))
    return out


def load_vision_encoder(spec: dict, device: str = "cpu") -> Gemma3VisionEncoder:
    """The encoder of an ``image_features`` spec ``{name, pretrained, **options}``. Raises ``ValueError``
    (:func:`image_features_problems`)."""
    if problems := image_features_problems(**spec):
        raise ValueError(f"image_features{problems[0][0]}: {problems[0][1]}")
    return VISION_ENCODERS[spec.get("name", "gemma3")](spec["pretrained"], device=device, **{
        k: v for k, v in spec.items() if k not in ("name", "pretrained")})


class ImageFeaturesProducer(Producer):
    """``image_features`` int16 ``(n_images, tokens, hidden)`` (bfloat16 bits) of each sample with
    images (see the module docstring); samples without images get nothing. Reads
    ``sample.model_images`` (resized by the decode workers with the encoder's :attr:`image_input`)
    when the sample has them, else decodes the sources the conversation names (``add-field``) with
    ``image_rgb`` and resizes them itself.

    ``encoder``: a :class:`Gemma3VisionEncoder` or one with its attributes (``image_input``,
    ``submit(resized) -> Pending``, ``image_sequence``, ``boi_token``, ``image_token``, ``eoi_token``,
    ``tokens_per_image``, ``hidden_size``, ``describe()``)."""

    name = "image_features"
    #: ``"*"``: the spec's other keys are an image_features encoder spec (``name``, ``pretrained``, ``dtype``)
    OPTION_EFFECTS = {"producer": BYTES, "image_rgb": BYTES, "*": SPEC}

    @classmethod
    def spec_problems(cls, field: str, **spec: Any) -> list[tuple[str, str]]:
        return image_features_problems(field, **spec)

    @classmethod
    def from_spec(cls, field: str, device: str = "cpu", **options: Any) -> "ImageFeaturesProducer":
        return make_image_features(field=field, device=device, **options)
    needs_images = True

    def __init__(self, encoder: Any, field: str = "image_features", image_rgb: str = "composite"):
        self.encoder, self.field, self.image_rgb = encoder, field, image_rgb
        self.outputs = (field,)
        self.image_input = encoder.image_input
        inner = tuple(t for t in (encoder.image_token, encoder.eoi_token) if t)
        self.image_tokens = ImageTokens(encoder.boi_token, encoder.image_sequence, inner) \
            if encoder.image_sequence else None

    @property
    def image_sequence(self) -> str:
        """The text each image placeholder becomes in ``input_ids`` (``Gemma3Processor.full_image_sequence``)."""
        return self.encoder.image_sequence

    def describe(self) -> dict[str, Any]:
        return super().describe() | {"encoder": self.encoder.describe(), "image_rgb": self.image_rgb}

    def manifest_info(self) -> dict[str, Any]:
        return {"tokens_per_image": self.encoder.tokens_per_image, "hidden_size": self.encoder.hidden_size,
                "dtype": "bfloat16", "storage": "int16 bit patterns of bfloat16 (shards.kinds.BFloat16Bits)",
                "image_sequence": self.encoder.image_sequence}

    def _images(self, s) -> list[np.ndarray]:
        if s.model_images or not s.conversation.images:
            return list(s.model_images)
        from ..images import decode_image
        return [self.image_input(np.array(decode_image(im.source, rgb=self.image_rgb), dtype=np.uint8))
                for im in s.conversation.images]

    def produce(self, samples: list, timer: Timer) -> list[dict[str, Any] | Exception]:
        return self.submit(samples, timer).result()

    def submit(self, samples: list, timer: Timer) -> Pending:
        where, images = [], []
        for j, s in enumerate(samples):
            try:
                for k, img in enumerate(self._images(s)):
                    where.append((j, k))
                    images.append(img)
            except Exception as e:  # noqa: BLE001 - travels with its sample
                reraise_infrastructure(e)
                where.append((j, -1))
                images.append(e)
        ok = [i for i, im in enumerate(images) if not isinstance(im, Exception)]
        pend = submit_each(self.encoder.submit, [images[i] for i in ok])

        def finish() -> list[dict[str, Any] | Exception]:
            feats = dict(zip(ok, pend.result()))
            per: dict[int, list] = {}
            for i, (j, _) in enumerate(where):
                per.setdefault(j, []).append(images[i] if isinstance(images[i], Exception) else feats[i])
            out: list[dict[str, Any] | Exception] = []
            for j in range(len(samples)):
                got = per.get(j, [])
                bad = next((f for f in got if isinstance(f, Exception)), None)
                out.append(bad if bad is not None else ({self.field: np.stack(got)} if got else {}))
            return out

        return Pending(finish)


def make_image_features(field: str = "image_features", device: str = "cpu", image_rgb: str = "composite",
                        **spec: Any) -> ImageFeaturesProducer:
    """The registered producer ``image_features`` (options: the ``image_features`` spec ``name``,
    ``pretrained``, ``revision``, ``dtype``; and ``image_rgb``)."""
    return ImageFeaturesProducer(load_vision_encoder(spec, device), field, image_rgb)


__all__ = ["ProcessorResize", "normalize", "Gemma3VisionEncoder", "ImageFeaturesProducer", "VISION_ENCODERS", "image_features_problems",
           "load_vision_encoder", "make_image_features"]
