"""The gateway's local engines: ``pool.py`` runs every replica of the local models (start, put to
sleep, wake, stop, restart, roll on edit), ``replica.py`` is one replica's lifecycle as an explicit
state machine, and ``process.py`` one engine process (its command line, spawning, output, the
engine endpoints the pool calls). Which models should be awake is residency's call
(gateway/residency/)."""
