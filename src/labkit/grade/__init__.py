"""Autograded exercises: student versions, sandboxed grading, Gradescope autograders.

- :mod:`.exercise`  an exercise folder (``exercises/<id>/``) and its points table
- :mod:`.notebook`  the submission cells of a notebook; the student version (stubs)
- :mod:`.harness`   what tests use: the ``submission`` they call, guarded buffers, checks
- :mod:`.sandbox`   the process a submission runs in, with its limits; :mod:`.worker` is
  the code inside it, :mod:`.wire` the format they speak
- :mod:`.runner`    pytest in the grader's process, scores from the table, results.json
- :mod:`.student`   ``check()``, the notebook's public tests
- :mod:`.build`     the student folder, the Gradescope zip, and the self-test of an exercise

``python -m labkit.grade --help`` lists the commands.
"""

from __future__ import annotations


def check(exercise_id: str, namespace: dict | None = None):
    """Run an exercise's public tests on the notebook's functions and explain what fails."""
    import inspect

    from .student import check as _check

    if namespace is None:  # the notebook's globals: where its cells defined the functions
        caller = inspect.currentframe().f_back
        namespace = caller.f_globals if caller is not None else {}
    return _check(exercise_id, namespace)


__all__ = ["check"]
