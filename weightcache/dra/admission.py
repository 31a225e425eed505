"""The label that tells deploy/dra/claim-policy.yaml which model a ModelCache declares.

The policy refuses a ResourceClaim for a model's devices in a namespace a ModelCache does not grant, before the
scheduler gives the claim one of the model's slots. Claims name the model by its key (the devices' `model`
attribute, `weightcache.uri.model_key` of the canonical source), and CEL cannot hash `spec.source` into that key,
so the ModelCache carries it as a label:

    kubectl label modelcache llama-3-8b $(python -m weightcache.dra.admission s3://models/llama-3-8b/)
"""

from __future__ import annotations

import argparse
import sys

from weightcache.uri import model_key, parse_ref
from weightcache.vocabulary import MODEL_KEY_LABEL

__all__ = ["MODEL_KEY_LABEL", "model_key_label"]


def model_key_label(source: str) -> str:
    """The label value for a ModelCache of `source`: the key its devices publish as `model` (globs are not part
    of it, as they are not part of the devices' key)."""
    return model_key(parse_ref(source).uri)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print the label a ModelCache needs for DRA claim admission "
                                                 "(docs/dra.md).")
    parser.add_argument("source", help="the ModelCache's spec.source, e.g. s3://models/llama-3-8b/")
    args = parser.parse_args(argv)
    print(f"{MODEL_KEY_LABEL}={model_key_label(args.source)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
