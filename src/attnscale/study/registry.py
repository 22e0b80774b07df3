"""The registered studies, by name: ``attnscale study NAME`` runs any of them."""

from __future__ import annotations

from attnscale.errors import lookup
from attnscale.study.spec import Study

STUDIES: dict[str, Study] = {}


def register(study: Study) -> Study:
    """Enter ``study`` into :data:`STUDIES` under its name; a second study of that name is
    refused, as a second mechanism or experiment of one name is."""
    if not isinstance(study, Study):
        raise TypeError(f"register takes a Study, got {type(study).__name__}")
    if study.name in STUDIES:
        raise ValueError(f"study {study.name!r} is already registered")
    for key, trials in study.stores.items():
        quick = (study.quick or {}).get(key)
        if study.quick is not None and quick is None and not trials.default_only:
            raise ValueError(f"study {study.name!r}: its quick variant lacks store {key!r}")
        if quick is not None and set(quick.grid) != set(trials.grid):
            raise ValueError(f"study {study.name!r}: store {key!r} has other grid axes when "
                             "quick; the analysis shows the same axes in both")
    unknown = [name for name in study.page_figures if name not in study.figures]
    if unknown:
        raise ValueError(f"study {study.name!r}: page_figures names {', '.join(unknown)}, which "
                         "its figures lack")
    for key in (study.quick or {}):
        if key not in study.stores:
            raise ValueError(f"study {study.name!r}: its quick variant has store {key!r}, which "
                             "the full study lacks")
        if study.quick[key].folder != study.stores[key].folder:
            raise ValueError(f"study {study.name!r}: store {key!r} lives in another folder when "
                             "quick")
    STUDIES[study.name] = study
    return study


def get(name: str) -> Study:
    """The study registered as ``name``; an unknown name gets a "did you mean"."""
    return lookup(STUDIES, name, "study", "Studies")
