"""Typed errors for bad input to the model adapter.

Each is a ``ValueError`` so callers that do not care can catch one thing; the
gateway maps them to 400 responses and never to a 500.
"""

from __future__ import annotations


class AdapterInputError(ValueError):
    """The request cannot be run by this model as given (a client mistake)."""

    code = "invalid_request"


class ImagePlaceholderMismatch(AdapterInputError):
    code = "image_placeholder_mismatch"


class InvalidImage(AdapterInputError):
    code = "invalid_image"


class TooManyImages(AdapterInputError):
    code = "too_many_images"


class PromptTooLong(AdapterInputError):
    code = "context_length_exceeded"
