"""scripts/bench_attacks.py's parts: denial-of-service attacks replayed against a real
`modelyard serve` while a victim client keeps sending valid requests.

The fleet: ``fleet`` (`modelyard serve` from a checkout, its engine; /proc through
common/processes.py). The bystanders, each in its own thread: ``victim`` (small chats and /health
polls from another address) and ``rss`` (resident sets every 50 ms). The attacker: ``raw_http`` (one
request on its own connection, sent whole), one module per attack family (``bodies``: encoded,
huge and poison bodies; ``choices``: n=10000; ``ejection``: engine-500 rounds; ``slow``: slow
clients; ``connections``: silent connections by the ten thousand) sharing ``context.Ctx``; and
``suite`` (the attacks in order, one run per checkout) and ``report`` (side by side).
"""
