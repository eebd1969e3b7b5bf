"""Importing this module runs ``install()``: a hook for verl's ``VERL_USE_EXTERNAL_MODULES``.

verl imports every module named in ``VERL_USE_EXTERNAL_MODULES`` at the end of
``import verl``, in every process that imports it -- its Ray workers too, when
the variable is in their environment (e.g. the job's ``runtime_env``). So::

    VERL_USE_EXTERNAL_MODULES=stateshift.integrations.verl.autoinstall python3 -m verl.trainer.main_ppo ...

puts the drop-ins in place in each worker before its engines are built, with
no change to verl or to the workers. Settings come from the environment:

- ``STATESHIFT_VERL_FUNCTIONS``: ``safe`` (default), ``all``, or names separated by commas;
- ``STATESHIFT_VERL_PLACEMENT``: ``host`` (default) or ``device``.

``INSTALLATION`` is what ``install()`` returned (it also logs it).
"""

from __future__ import annotations

import os

from .install import Installation, install


def _functions(value: str) -> str | list[str]:
    value = value.strip()
    return value if value in ("safe", "all") else [n.strip() for n in value.split(",") if n.strip()]


INSTALLATION: Installation = install(
    placement=os.environ.get("STATESHIFT_VERL_PLACEMENT", "host").strip(),  # type: ignore[arg-type]
    functions=_functions(os.environ.get("STATESHIFT_VERL_FUNCTIONS", "safe")),
)
