"""What the test modules share: stand-ins, planted bugs and their judges, case lists and the
helpers that run the suite again in a child session. Test modules import from here (and from
``tests/*.py``), never from one another."""
