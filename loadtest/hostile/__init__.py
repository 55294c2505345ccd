"""`specgate loadtest hostile`: can one tenant hurt another? An adversarial load test (issue 50).

    specgate loadtest hostile --window-s 20 --json results/loadtest_hostile_before.json
    specgate loadtest hostile --redis-url redis://127.0.0.1:6379/0 --patterns tools,stored
    specgate loadtest hostile --url http://host:8000 --victim-key sk-.. --attacker-key sk-.. \\
        --admin-key sk-.. --grpc-target host:50051

A gateway (started here with `specgate serve`, or `--url`) serves two tenants with the same
generous quotas. The victim runs a steady, modest load: a short streamed chat every half second
(`victim.Victim`). After a quiet baseline window, the attacker runs each pattern in turn for
`--window-s` seconds, within its own quotas, from a process of its own (`attacks`):

    busy       not an attack: ordinary streamed chats keeping the batch full, the yardstick of
               what any busy neighbour costs the victim (each pattern's ratios to it are reported)
    tools      chat requests carrying 28 tools of 60 KB descriptions (1.6 MiB bodies)
    schema     json_schema response formats that are costly to compile, each a new cache key
    bytes      resumable streams forced to byte tokens (U+FFFD alone), then replays of them
    stored     many small stored background responses, to fill the store
    followers  many concurrent followers of its own long response and long chat stream
    grpc       gRPC prompts near and over the HTTP body cap and gRPC's 4 MiB limit
    idle       streaming requests on sockets that are never read

After each pattern the gateway is waited out (its live requests back to the victim's own), and
a quiet window closes the run. Throughout, GET /health is probed every ~100 ms, and Redis
`used_memory` and the gateway's RSS sampled every second. Per pattern the report
(`report`, whose docstring lists the targets) has the victim's TTFT and time between tokens
p50/p99 and their ratio to the baseline, /health latency, status codes by tenant and the codes
the attacker was refused with, memory, a loop-lag series of /metrics where the gateway exposes
one (else /health's latency stands for it), whether any victim request lost anything, and
PASS/FAIL per target.
"""
from loadtest.hostile.runner import add_arguments, run

__all__ = ["add_arguments", "run"]
