"""Decoding NVML's clock-event (throttle) reason bitmask (nvidia-smi -q -d PERFORMANCE)."""

REASONS = {
    0x1: "idle", 0x2: "app clocks", 0x4: "SW power cap", 0x8: "HW slowdown", 0x10: "sync boost",
    0x20: "SW thermal", 0x40: "HW thermal", 0x80: "HW power brake", 0x100: "display clocks",
}
# reasons that mean the GPU is being held back while it has work (idle and app settings are not)
LIMITING = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


def decode(mask: int | None) -> list[str]:
    if mask is None:
        return []
    return [name for bit, name in REASONS.items() if mask & bit]
