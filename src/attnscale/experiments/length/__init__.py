"""The length study (issue 13, sections 3 and 4): how the attention temperature copes with more
keys than training saw.

* :mod:`~attnscale.experiments.length.recall`: the ``recall-length`` experiment, recall trained
  at 16 pairs and evaluated at 16 to 512;
* :mod:`~attnscale.experiments.length.lm`: the ``lm-length`` experiment, the small LM trained at
  context 128 and evaluated to 1024, and YaRN's temperature law measured;
* :mod:`~attnscale.experiments.length.report`: claims, figures and the report fragment, drawn
  from the two sweep stores; :func:`~attnscale.experiments.length.report.run_study` runs both.
"""
