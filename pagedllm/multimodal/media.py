"""Images from the URLs of OpenAI content parts: ``data:`` URLs decoded, ``http(s)`` URLs fetched with a timeout
and a size limit, ``file://`` URLs read only under the allowed local media directory (the engine argument
--allowed-local-media-path, ``LLM(allowed_local_media_path=...)`` offline); every failure is a ValueError saying
what was wrong (the server answers 400 with it)."""
from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: URL schemes an image may come from ("file" only with MediaLimits.allowed_local_media_path).
ALLOWED_SCHEMES = ("data", "http", "https", "file")
LOCAL_MEDIA_FLAG = "--allowed-local-media-path"
#: The flag and the LLM keyword argument, as errors name the setting (one engine argument, vLLM's).
LOCAL_MEDIA_SETTING = f"{LOCAL_MEDIA_FLAG} (LLM's allowed_local_media_path)"


@dataclass(frozen=True)
class MediaLimits:
    """Bounds on one fetched image (vLLM's VLLM_IMAGE_FETCH_TIMEOUT is 5 s)."""

    fetch_timeout_s: float = 5.0
    max_bytes: int = 20 * 2**20
    max_pixels: int = 64 * 2**20  # decoded width × height: refuses decompression bombs
    #: --allowed-media-domains: the only hosts http(s) images may come from, redirects refused (None: any host).
    allowed_domains: tuple[str, ...] | None = None
    #: --allowed-local-media-path: the directory file:// images may be read from, at any depth, after symlinks
    #: and '..' are resolved (None: no local file at all).
    allowed_local_media_path: str | None = None


def resolve_local_media_dir(path: str | os.PathLike[str] | None, name: str = LOCAL_MEDIA_FLAG) -> str | None:
    """The allowed local media directory as an absolute path with symlinks resolved, checked at start-up; None
    when not given (None or "", vLLM's default). A ValueError naming `name` (the flag, or LLM's keyword) unless
    `path` is an existing directory."""
    if path is None or path == "":
        return None
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path).strip():
        raise ValueError(f"{name} must name a directory (a path string), got {path!r}.")
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_dir():
        what = "not a directory" if resolved.exists() else "no such directory"
        raise ValueError(f"{name} {os.fspath(path)}: {what}; give an existing directory whose files an image_url "
                         f"may name as file:///abs/path.")
    return str(resolved)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """With an allow-list, a redirect could lead anywhere: it is refused as the HTTP error it is."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D102 (urllib's hook)
        return None


def _short(url: str, n: int = 60) -> str:
    return url if len(url) <= n else url[:n] + "..."


def decode_image_bytes(data: bytes, source: str, limits: MediaLimits = MediaLimits()) -> Any:
    """The PIL image in `data` (fully decoded, so a truncated file fails here); ValueError naming `source`."""
    from PIL import Image

    if len(data) > limits.max_bytes:
        raise ValueError(f"the image at {source} has {len(data)} bytes, more than the {limits.max_bytes} allowed.")
    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > limits.max_pixels:
            raise ValueError(f"the image at {source} is {img.width}x{img.height} pixels, more than the "
                             f"{limits.max_pixels} allowed.")
        img.load()
    except ValueError:
        raise
    except Exception as e:  # PIL.UnidentifiedImageError, OSError (truncated), DecompressionBombError
        raise ValueError(f"the data at {source} is not an image this server can read (PNG, JPEG, GIF, WebP, ...): "
                         f"{e}") from None
    return img


def _decode_data_url(url: str, limits: MediaLimits) -> Any:
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError(f"image_url {_short(url)!r}: a data URL must look like 'data:image/png;base64,<base64 "
                         f"data>'.")
    mime = header[: -len(";base64")]
    if mime and not mime.startswith("image/"):
        raise ValueError(f"image_url {_short(url)!r}: the data URL's media type is {mime!r}, not an image/* type.")
    if len(payload) > limits.max_bytes * 4 // 3 + 4:
        raise ValueError(f"image_url data URL: more than the {limits.max_bytes} bytes allowed.")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image_url data URL: the payload is not valid base64.") from None
    return decode_image_bytes(data, "the data URL", limits)


def _check_domain(url: str, limits: MediaLimits) -> None:
    if limits.allowed_domains is None:
        return
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in limits.allowed_domains:
        raise ValueError(f"image_url {_short(url)!r}: the host {host!r} is not in the server's "
                         f"--allowed-media-domains ({', '.join(limits.allowed_domains)}).")


def _fetch(url: str, limits: MediaLimits) -> bytes:
    _check_domain(url, limits)
    req = urllib.request.Request(url, headers={"User-Agent": "pagedllm", "Accept": "image/*"})
    opener = urllib.request.build_opener(_NoRedirects) if limits.allowed_domains is not None \
        else urllib.request.build_opener()
    try:
        with opener.open(req, timeout=limits.fetch_timeout_s) as resp:  # noqa: S310 (scheme checked)
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > limits.max_bytes:
                raise ValueError(f"image_url {_short(url)!r}: {length} bytes, more than the {limits.max_bytes} "
                                 f"allowed.")
            data = resp.read(limits.max_bytes + 1)
    except urllib.error.HTTPError as e:
        raise ValueError(f"image_url {_short(url)!r} could not be fetched: HTTP {e.code} {e.reason}.") from None
    except (urllib.error.URLError, OSError) as e:  # refused, unknown host, timeout
        reason = getattr(e, "reason", e)
        raise ValueError(f"image_url {_short(url)!r} could not be fetched (timeout {limits.fetch_timeout_s:g} s): "
                         f"{reason}.") from None
    if len(data) > limits.max_bytes:
        raise ValueError(f"image_url {_short(url)!r}: more than the {limits.max_bytes} bytes allowed.")
    return data


def local_media_file(url: str, limits: MediaLimits) -> Path:
    """The file a ``file:///abs/path`` URL names, resolved (symlinks, '..'); a ValueError naming
    --allowed-local-media-path unless the resolved file lies under that directory."""
    root = limits.allowed_local_media_path
    if root is None:
        raise ValueError(f"image_url {_short(url)!r}: local files (file://) are refused; those under a directory "
                         f"DIR are allowed only with {LOCAL_MEDIA_FLAG} DIR (LLM(allowed_local_media_path=DIR) "
                         f"offline).")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"image_url {_short(url)!r}: a file URL names no remote host; write file:///abs/path.")
    path = Path(urllib.request.url2pathname(parts.path))
    if not path.is_absolute():
        raise ValueError(f"image_url {_short(url)!r}: a file URL needs an absolute path: file:///abs/path.")
    try:
        resolved, base = path.resolve(), Path(root).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise ValueError(f"image_url {_short(url)!r}: the path cannot be resolved: {e}.") from None
    if resolved == base or not resolved.is_relative_to(base):
        raise ValueError(f"image_url {_short(url)!r}: the file is not under the allowed local media directory "
                         f"{root} ({LOCAL_MEDIA_SETTING}); symlinks and '..' count where they lead.")
    return resolved


def _read_local(url: str, limits: MediaLimits) -> bytes:
    path = local_media_file(url, limits)
    try:
        # The resolved path is opened, so the file checked is the file read.
        with open(path, "rb") as f:
            data = f.read(limits.max_bytes + 1)
    except OSError as e:
        raise ValueError(f"image_url {_short(url)!r} could not be read: {e.strerror or e}.") from None
    if len(data) > limits.max_bytes:
        raise ValueError(f"image_url {_short(url)!r}: more than the {limits.max_bytes} bytes allowed.")
    return data


def load_image_url(url: Any, limits: MediaLimits = MediaLimits()) -> Any:
    """The PIL image an image_url names (blocking: a fetch waits up to the timeout)."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"image_url must be a non-empty URL string, got {url!r}.")
    scheme = urllib.parse.urlsplit(url).scheme.lower() if not url.startswith("data:") else "data"
    if scheme not in ALLOWED_SCHEMES:
        raise ValueError(f"image_url {_short(url)!r}: scheme {scheme!r} is not allowed; allowed: data, http, "
                         f"https, and file with {LOCAL_MEDIA_SETTING}.")
    if scheme == "data":
        return _decode_data_url(url, limits)
    if scheme == "file":
        return decode_image_bytes(_read_local(url, limits), repr(_short(url)), limits)
    return decode_image_bytes(_fetch(url, limits), repr(_short(url)), limits)


async def load_image_url_async(url: Any, limits: MediaLimits = MediaLimits()) -> Any:
    """`load_image_url` off the event loop (a fetch or a large decode never stalls other requests)."""
    if isinstance(url, str) and url.startswith("data:") and len(url) < 256 * 1024:
        return load_image_url(url, limits)
    return await asyncio.to_thread(load_image_url, url, limits)
