"""Sizes and durations as people read them, for error messages and the CLI alike."""

from __future__ import annotations


def fmt_bytes(n: int) -> str:
    """`512 B`, `8.0 KiB`, `1.5 GiB`: binary units, one decimal."""
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} PiB"


def fmt_duration(seconds: float) -> str:
    """`250ms`, `4.2s`, `3m07s`, `2h05m`, `1d03h`: short, and never more precise than useful."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"
