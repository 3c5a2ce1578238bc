"""What every attack gets: the fleet, the victim, the sampler, the command line and the
payloads built once for all runs."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from scripts.attacks.fleet import Fleet
from scripts.attacks.rss import RssSampler
from scripts.attacks.victim import Victim

ATTACK_CAP_S = 300.0


@dataclass
class Ctx:
    fleet: Fleet
    victim: Victim
    sampler: RssSampler
    args: argparse.Namespace
    payloads: dict[str, bytes]
