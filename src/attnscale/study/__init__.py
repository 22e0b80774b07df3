"""Studies: grids of trials on the sweep engine, drawn into a report fragment.

A study is data (:class:`~attnscale.study.spec.Study`): its sweep stores, a quick variant, the
options a user may change, and an analysis from records to tables, claims and figures.  One
launcher (:mod:`~attnscale.study.launcher`) runs, resumes and redraws every registered study,
and ``attnscale study NAME`` is its command line.

* :mod:`~attnscale.study.spec`, :mod:`~attnscale.study.registry`: the spec and the registry;
* :mod:`~attnscale.study.launcher`: run, resume, redraw, and the rules every study keeps;
* :mod:`~attnscale.study.fragment`: the study folder's report (``reproduce --include``);
* :mod:`~attnscale.study.claims`, :mod:`~attnscale.study.seeds`: claims over seeds, one wording,
  and one seed aggregation;
* :mod:`~attnscale.study.recall`, :mod:`~attnscale.study.lm`, :mod:`~attnscale.study.length`,
  :mod:`~attnscale.study.extend`: the studies attnscale ships, one file each (importing one
  registers it);
* :mod:`~attnscale.study.page`: the results page over their folders (``attnscale results``).

A new study is one more file in this folder, imported below: importing it runs its
``register(Study(...))``, which makes it ``attnscale study NAME``.  The imports are the
registration (and their order that of ``attnscale study --list``); a study of one's own registers
the same way from any module one imports.
"""

from attnscale import sweep  # noqa: F401  (registers the experiments the studies run)
from attnscale.study.registry import STUDIES, get, register
from attnscale.study.spec import Analysis, Option, Study, Trials
from attnscale.study import recall, lm, length, extend  # noqa: F401,E402  (registers the studies)

__all__ = ["STUDIES", "Analysis", "Option", "Study", "Trials", "get", "register"]
