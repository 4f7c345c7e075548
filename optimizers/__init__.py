"""Compile stages (``flowopt.optimizers``): found by name through the ``flowopt.stages`` entry points.

``labeled`` / ``demos`` (:mod:`.demos`), ``search`` (:mod:`.search`), ``structure`` and the weights
stages live in their own modules; import a stage class from its module to pass settings, e.g.
``from flowopt.optimizers.search import RandomSearch``.
"""
