"""What is done with a finished run folder: restore its classifier (:mod:`~isojax.runs.folder`),
predict a GLUE split and write submission files (:mod:`~isojax.runs.predict`), export it as a
Hugging Face folder (:mod:`~isojax.runs.export`).

    restored = isojax.runs.restore("runs/rte-isobn", best=True)
    logits, _ = restored.apply(restored.variables, ids, mask, types)
"""

from isojax.runs.folder import (
    RUN_FILES,
    Restored,
    RunNotRestorable,
    is_run_folder,
    load_config,
    restore,
    run_owning,
)

__all__ = [
    "RUN_FILES",
    "Restored",
    "RunNotRestorable",
    "is_run_folder",
    "load_config",
    "restore",
    "run_owning",
]
