"""``target="auto"``: compile for every candidate target, verify, time each in a process of its own, keep the fastest.

* ``search`` — :func:`compile_auto`: candidates, compile, verify, time, pick;
* ``rank`` — the samplers and the ranking (rotated rounds, sign test, tie-break rounds).
"""
