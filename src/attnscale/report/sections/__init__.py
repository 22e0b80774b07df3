"""Report sections: one module per experiment.

A section is a function ``fn(fig_dir: Path, *, seed: int, full: bool) -> attnscale.report.Section``
that runs its experiment, saves its PNG figures into ``fig_dir`` and returns its rows, its
measurements (keyed by claim ids of :mod:`attnscale.report.claims`) and its figure captions.
``full`` asks for the long form (``attnscale reproduce --full``): the training demo trains more
seeds; the Monte Carlo sections run the essay's sample sizes either way.  The report lists them, in
order, in :data:`attnscale.report.reproduce.SECTIONS`:

- :mod:`~attnscale.report.sections.montecarlo`: the variance check, Figures 1-2, the small-head
  thresholds, and saturation at init for every mechanism;
- :mod:`~attnscale.report.sections.keys`: entropy and max weight vs the number of keys n at
  init, and a planted key (named for the keys, not "length": ``attnscale study length`` is the
  trained extrapolation study);
- :mod:`~attnscale.report.sections.gradient`: the two gradient paths and init-reparam;
- :mod:`~attnscale.report.sections.recall`: the training demo (Figure 3).
"""
