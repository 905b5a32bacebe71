"""The orchestration layer: the Prefect flow `rlhf` and `rlhf pipeline`.

Importing any flow module first puts the embedded default's Prefect settings in place
(`flows/embedded.py`): Prefect reads them once, when it is imported.
"""

from flows.embedded import configure

configure()
