"""Command-line options shared by ``epd simulate`` and ``epd plan``: service times and the request mix."""

from __future__ import annotations

import argparse

from runtime.policy.cost_model import CostModel
from runtime.policy.service_times import GIB, KIB, ServiceTimes
from sim.distributions import parse_distribution
from sim.workload import RequestMix

# flag -> (ServiceTimes field, factor from the flag's unit to the field's unit, flag type, help)
_SERVICE_FLAGS: dict[str, tuple[str, float, type, str]] = {
    "--prefill-base-ms": ("prefill_base_ms", 1.0, float, "fixed prefill cost (default 20)"),
    "--prefill-ms-per-token": ("prefill_ms_per_token", 1.0, float, "prefill cost per prompt token (default 0.035)"),
    "--prefill-ms-per-token2": ("prefill_ms_per_token2", 1.0, float, "prefill cost per prompt token squared (default 0)"),
    "--prefill-chunk-overhead-ms": ("prefill_chunk_overhead_ms", 1.0, float, "extra cost per prefill chunk (default 0)"),
    "--decode-step-ms": ("decode_step_base_ms", 1.0, float, "decode step time at batch 0 (default 45)"),
    "--decode-step-ms-per-seq": ("decode_step_ms_per_seq", 1.0, float, "step growth per running sequence (default 0)"),
    "--decode-slots": ("decode_slots", 1, int, "running sequences per decode worker (default 32)"),
    "--kv-kib-per-token": ("kv_bytes_per_token", KIB, float, "KV cache per token in KiB (default 320)"),
    "--link-setup-ms": ("link_setup_ms", 1.0, float, "KV transfer setup time (default 12)"),
    "--link-gib-s": ("link_bytes_per_s", GIB, float, "KV link bandwidth in GiB/s (default 22)"),
    "--encode-base-ms": ("encode_base_ms", 1.0, float, "fixed encoder cost per request with images (default 10)"),
    "--encode-ms-per-token": ("encode_ms_per_token", 1.0, float,
                              "encoder cost per image token (default 0.15625: 40 ms for a 256-token image)"),
    "--encode-cache-hit-ms": ("encode_cache_hit_ms", 1.0, float, "cost of an encoder-cache hit (default 1)"),
    "--gateway-request-ms": ("gateway_request_ms", 1.0, float, "gateway CPU per request before its pipeline (default 0: no gateway stage)"),
    "--gateway-finish-ms": ("gateway_finish_ms", 1.0, float, "gateway CPU per request after it (default 0)"),
    "--encode-request-ms": ("encode_request_ms", 1.0, float, "encoder CPU per request that encodes, beyond the encode (default 0)"),
    "--prefill-request-ms": ("prefill_request_ms", 1.0, float, "prefill worker CPU per request, beyond its passes (default 0)"),
    "--decode-request-ms": ("decode_request_ms", 1.0, float, "decode worker CPU per request, beyond its steps (default 0)"),
    "--decode-step-extra-ms": ("decode_step_extra_ms", 1.0, float, "decode worker CPU per step, beyond the step (default 0)"),
    "--hop-ms": ("hop_ms", 1.0, float, "per-request hand-off latency that is no stage's work (default 0)"),
    "--host-cores": ("host_cores", 1, int, "all stages share N cores (default 0: a processor per worker)"),
    "--host-background-cores": ("host_background_cores", 1.0, float, "other work on those cores, in cores (default 0)"),
}


def add_service_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("service times (defaults: the design chapter's worked example)")
    group.add_argument(
        "--service-times", metavar="FILE", help="service-time JSON (epd profile writes it); the flags below override it"
    )
    for flag, (_, _, kind, help_) in _SERVICE_FLAGS.items():
        group.add_argument(flag, type=kind, help=help_)


def service_from_args(args: argparse.Namespace) -> ServiceTimes:
    """File (fitted from its tables where present) or defaults, then per-flag overrides."""
    base = CostModel.from_file(args.service_times).service_times() if args.service_times else ServiceTimes()
    changes: dict[str, float | int] = {}
    for flag, (field_name, factor, _, _) in _SERVICE_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            scaled = value * factor
            changes[field_name] = int(round(scaled)) if field_name in ("decode_slots", "kv_bytes_per_token", "host_cores") else scaled
    return base.replace(**changes)


def add_mix_args(parser: argparse.ArgumentParser, *, prompt_default: str = "6000", output_default: str = "400") -> None:
    group = parser.add_argument_group(
        "request mix (a value or a distribution: uniform:A:B, normal:M:S, lognormal:MED:SIG, exp:M, mix:V@W,...)"
    )
    group.add_argument("--prompt-tokens", default=prompt_default, help=f"text tokens per prompt (default {prompt_default})")
    group.add_argument("--output-tokens", default=output_default, help=f"tokens generated per request (default {output_default})")
    group.add_argument("--images", default="0", help="images per request (default 0)")
    group.add_argument("--image-tokens", type=int, default=256,
                       help="placeholder tokens per image: prompt tokens, and the encode's size (default 256)")
    group.add_argument("--cache-hit-ratio", type=float, default=0.0, help="encoder-cache hit chance per image (default 0)")


def mix_from_args(args: argparse.Namespace) -> RequestMix:
    return RequestMix(
        prompt_tokens=parse_distribution(args.prompt_tokens, name="--prompt-tokens"),
        output_tokens=parse_distribution(args.output_tokens, name="--output-tokens"),
        images=parse_distribution(args.images, minimum=0, name="--images"),
        image_tokens=args.image_tokens,
        cache_hit_ratio=args.cache_hit_ratio,
    )
