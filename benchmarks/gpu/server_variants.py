"""The server step's variants (server.py): each a front end's environment, and the loads it is measured
under in turn. "full" is the plan's closed-loop clients, "half" the same clients paced at half what
"full" reached, "crowd" ``CROWD`` times the clients closed-loop (at 64 in flight on the H200 no
engine thread, API process or load process was busy past 0.6 of the wall: whether more requests in
flight reach the bound). The first model gets the plan's ``server_variants`` first variants, the
others the first alone at full load.

The first is the default front end on a GPU host (server/cli/serve.py: API processes before one
model process, chosen by the 2026-11-27 run: 2,000 img/s against 1,560 for 8 replicas and 680 for
one process), where the goals are judged (and the two keys measured). The second has the engine's
process wait for the GPU asleep (``MEMVIT_CUDA_WAITS=block``, memory_core/runtime.py) instead of
CUDA's spinning: whether the cores its decode threads and collector hold while waiting are worth
more to the rest. The third takes back the model process's second decode thread (a GPU's default,
server/settings.py, chosen alone against one thread in RESULTS §3.16): what it is worth beside the
rest. The fourth pads every decoder call with tiny JPEGs to 16, 32 or 64 images
(``MEMVIT_DEVICE_DECODE_CALL_SIZES``): torchvision initialises nvJPEG's batched decoder for each
call's size, and the server's batches come in every size (the decode bound's `at mixed sizes` rows
ask the same of the decoder alone). Then one process; the replicas and the CPU decoders, beyond the
plan's ``server_variants`` (5).
"""

from __future__ import annotations

API_PROCESSES = "8"
CALL_SIZES = "16,32,64"
GROUP = {"MEMVIT_API_PROCESSES": API_PROCESSES, "MEMVIT_FRONT_END": "model-process"}
VARIANTS: tuple[tuple[str, dict[str, str], tuple[str, ...]], ...] = (
    (f"{API_PROCESSES} API processes, one model process (default)", GROUP, ("full", "half", "crowd")),
    (
        f"{API_PROCESSES} API processes, one model process, CUDA waits blocking",
        {**GROUP, "MEMVIT_CUDA_WAITS": "block"},
        ("full",),
    ),
    (
        f"{API_PROCESSES} API processes, one model process, 1 decode thread",
        {**GROUP, "MEMVIT_DEVICE_DECODE_THREADS": "1"},
        ("full",),
    ),
    (
        f"{API_PROCESSES} API processes, one model process, decoder calls padded to {CALL_SIZES}",
        {**GROUP, "MEMVIT_DEVICE_DECODE_CALL_SIZES": CALL_SIZES},
        ("full",),
    ),
    (
        "one process, JPEG decode on the device",
        {"MEMVIT_API_PROCESSES": "1", "MEMVIT_DECODE_DEVICE": "auto"},
        ("full",),
    ),
    (
        f"{API_PROCESSES} replicas",
        {"MEMVIT_API_PROCESSES": API_PROCESSES, "MEMVIT_FRONT_END": "replicas"},
        ("full",),
    ),
    (
        "one process, JPEG decode on the CPU",
        {"MEMVIT_API_PROCESSES": "1", "MEMVIT_DECODE_DEVICE": "cpu"},
        ("full",),
    ),
)


def variants(device: str) -> tuple:
    """``VARIANTS``, the device's default front end first, with the default's loads: on a CPU
    (``--cpu-smoke``) one process."""
    if device == "cuda":
        return VARIANTS
    (one,) = [v for v in VARIANTS if v[0].startswith("one process, JPEG decode on the device")]
    return ((*one[:2], VARIANTS[0][2]), *[v for v in VARIANTS if v is not one])
