"""The length study (``attnscale study length``; trained recall and a small LM, not the report's
entropy-vs-n section at init): how the attention temperature copes with more
keys than training saw.

* :mod:`~attnscale.experiments.length.recall`: the ``recall-length`` experiment, recall trained
  at 16 pairs and evaluated at 16 to 512;
* :mod:`~attnscale.experiments.length.lm`: the ``lm-length`` experiment, the small LM trained at
  context 128 and evaluated to 1024, and YaRN's temperature law measured;
* :mod:`~attnscale.experiments.length.report`: claims, figures and the report fragment, drawn
  from the two sweep stores; :func:`~attnscale.experiments.length.report.run_study` runs both.
"""
