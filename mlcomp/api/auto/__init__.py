"""``target="auto"``: compile for every candidate target, verify, time each in a process of its own, keep the fastest.

* ``search`` — :func:`compile_auto`: candidates, compile, verify, time, pick;
* ``rank`` — the samplers and the ranking (rotated rounds, sign test, clear losers dropped, tie-break rounds);
* ``record`` — earlier measurements per host kind, model and shape class (a second compile ranks from them);
* ``workers`` — the timing processes, started as each candidate is built.
"""
