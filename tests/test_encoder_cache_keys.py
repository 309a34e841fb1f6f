"""Content keys: same decoded picture -> same key; anything the embedding depends on -> another key."""

from __future__ import annotations

import io

import pytest
from PIL import Image, PngImagePlugin

from cache.keys import content_key, image_content_key, image_content_key_from_bytes, image_digest, preprocess_digest

MODEL = "Qwen/Qwen2-VL-2B-Instruct@rev-a"
PP = preprocess_digest({"image_mean": [0.5, 0.5, 0.5], "min_pixels": 3136})


def picture(mode: str = "RGB", size: tuple[int, int] = (24, 16)) -> Image.Image:
    image = Image.new("RGB", size)
    image.putdata([((x * 7) % 256, (y * 13) % 256, (x * y) % 256) for y in range(size[1]) for x in range(size[0])])
    return image.convert(mode)


def png_bytes(image: Image.Image, **save_args: object) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG", **save_args)
    return out.getvalue()


def test_key_is_64_hex_chars() -> None:
    key = image_content_key(picture(), MODEL, PP)
    assert len(key) == 64 and int(key, 16) >= 0


def test_resaved_png_with_other_compression_and_metadata_hits() -> None:
    image = picture()
    info = PngImagePlugin.PngInfo()
    info.add_text("Comment", "re-saved by another tool")
    plain = png_bytes(image, compress_level=1)
    other = png_bytes(image, compress_level=9, pnginfo=info)
    assert plain != other
    assert image_content_key_from_bytes(plain, MODEL, PP) == image_content_key_from_bytes(other, MODEL, PP)
    assert image_content_key_from_bytes(plain, MODEL, PP) == image_content_key(image, MODEL, PP)


def test_gateway_and_encoder_agree_on_a_jpeg() -> None:
    out = io.BytesIO()
    picture().save(out, "JPEG", quality=80)
    data = out.getvalue()
    with Image.open(io.BytesIO(data)) as decoded:
        assert image_content_key(decoded, MODEL, PP) == image_content_key_from_bytes(data, MODEL, PP)


def test_model_and_preprocessing_are_part_of_the_key() -> None:
    image = picture()
    base = image_content_key(image, MODEL, PP)
    assert image_content_key(image, MODEL + "-other-revision", PP) != base
    assert image_content_key(image, MODEL, preprocess_digest({"image_mean": [0.5, 0.5, 0.4]})) != base
    assert content_key(image_digest(image), MODEL, PP) == base


def test_pixels_size_and_mode_are_part_of_the_key() -> None:
    image = picture()
    changed = image.copy()
    changed.putpixel((3, 3), (1, 2, 3))
    assert image_digest(changed) != image_digest(image)
    assert image_digest(picture("RGBA")) != image_digest(image)
    raw = bytes(range(64))
    assert image_digest(Image.frombytes("L", (8, 8), raw)) != image_digest(Image.frombytes("L", (4, 16), raw))


def test_palette_is_part_of_the_key() -> None:
    first = Image.new("P", (8, 8), 1)
    first.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    second = first.copy()
    second.putpalette([0, 0, 0, 0, 0, 255] + [0] * 762)
    assert first.tobytes() == second.tobytes()
    assert image_digest(first) != image_digest(second)


def test_exif_orientation_is_part_of_the_key_but_other_exif_is_not() -> None:
    image = picture()

    def with_exif(**tags: object) -> bytes:
        exif = Image.Exif()
        for tag, value in tags.items():
            exif[{"orientation": 0x0112, "software": 0x0131}[tag]] = value
        return png_bytes(image, exif=exif.tobytes())

    upright = image_content_key_from_bytes(with_exif(orientation=1), MODEL, PP)
    assert image_content_key_from_bytes(with_exif(orientation=1, software="x"), MODEL, PP) == upright
    assert image_content_key_from_bytes(with_exif(orientation=6), MODEL, PP) != upright


def test_preprocess_digest_is_canonical() -> None:
    a = {"size": {"h": 224, "w": 224}, "mean": (0.5, 0.25), "resample": 3}
    b = {"resample": 3, "mean": [0.5, 0.25], "size": {"w": 224, "h": 224}}
    assert preprocess_digest(a) == preprocess_digest(b)
    assert preprocess_digest({**a, "resample": 2}) != preprocess_digest(a)


def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(TypeError, match="no stable JSON form"):
        preprocess_digest({"dtype": object()})
    with pytest.raises(TypeError, match="mapping"):
        preprocess_digest([("a", 1)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model_fingerprint"):
        image_content_key(picture(), "", PP)
    with pytest.raises(ValueError, match="not a decodable image"):
        image_content_key_from_bytes(b"definitely not an image", MODEL, PP)


# -- cache_salt: tenants' namespaces ------------------------------------------------------------
# the key of picture() under MODEL/PP computed by the code before salts existed
UNSALTED_KEY_BEFORE_SALTS = "8ee801070b0e564f536b64335d50f3e87032ac02d66394b300e4d0682a463fa0"


def test_empty_salt_keeps_the_keys_of_before_salts_byte_for_byte() -> None:
    image = picture()
    assert image_content_key(image, MODEL, PP) == UNSALTED_KEY_BEFORE_SALTS
    assert image_content_key(image, MODEL, PP, "") == UNSALTED_KEY_BEFORE_SALTS
    assert content_key(image_digest(image), MODEL, PP, cache_salt="") == UNSALTED_KEY_BEFORE_SALTS


def test_salt_is_part_of_the_key_and_both_sides_agree() -> None:
    image = picture()
    a, b = image_content_key(image, MODEL, PP, "tenant-a"), image_content_key(image, MODEL, PP, "tenant-b")
    assert len({a, b, UNSALTED_KEY_BEFORE_SALTS}) == 3
    assert image_content_key(image, MODEL, PP, "tenant-a") == a   # deterministic
    assert image_content_key_from_bytes(png_bytes(image), MODEL, PP, "tenant-a") == a   # the encoder's derivation


def test_salt_fields_do_not_run_together() -> None:
    # length-prefixed fields: moving characters between the preprocess digest and the salt changes the key
    digest = image_digest(picture())
    assert content_key(digest, MODEL, "pp", "xsalt") != content_key(digest, MODEL, "ppx", "salt")
    assert content_key(digest, MODEL + "a", PP, "b") != content_key(digest, MODEL, PP, "ab")


def test_salt_must_be_a_string() -> None:
    with pytest.raises(ValueError, match="cache_salt"):
        content_key(image_digest(picture()), MODEL, PP, None)  # type: ignore[arg-type]


# -- layout variants: one picture in two forms (LLaVA-OneVision's multi-image form) -------------
def test_the_empty_layout_variant_keeps_the_keys_of_before_variants_byte_for_byte() -> None:
    image = picture()
    assert image_content_key(image, MODEL, PP, "", "") == UNSALTED_KEY_BEFORE_SALTS
    assert image_content_key(image, MODEL, PP, "tenant-a", "") == image_content_key(image, MODEL, PP, "tenant-a")


def test_the_layout_variant_is_part_of_the_key_and_both_sides_agree() -> None:
    image = picture()
    keys = {(salt, variant): image_content_key(image, MODEL, PP, salt, variant)
            for salt in ("", "tenant-a") for variant in ("", "multi-image", "other")}
    assert len(set(keys.values())) == len(keys)   # every salt and variant its own entry
    assert image_content_key_from_bytes(png_bytes(image), MODEL, PP, "tenant-a", "multi-image") == keys[
        ("tenant-a", "multi-image")]   # the encoder's derivation
    digest = image_digest(image)   # length-prefixed: characters moved between the salt and the variant change it
    assert content_key(digest, MODEL, PP, "ab", "c") != content_key(digest, MODEL, PP, "a", "bc")
    with pytest.raises(ValueError, match="layout_variant"):
        content_key(digest, MODEL, PP, "", None)  # type: ignore[arg-type]
