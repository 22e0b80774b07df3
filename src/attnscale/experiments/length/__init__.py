"""The length study's experiments: how the attention temperature copes with more
keys than training saw.

* :mod:`~attnscale.experiments.length.recall`: the ``recall-length`` experiment, recall trained
  at 16 pairs and evaluated at 16 to 512;
* :mod:`~attnscale.experiments.length.lm`: the ``lm-length`` experiment, the small LM trained at
  context 128 and evaluated to 1024, and YaRN's temperature law measured;

The study itself (its two stores, claims, figures and fragment) is :mod:`attnscale.study.length`.
"""
