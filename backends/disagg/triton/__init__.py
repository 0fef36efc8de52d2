"""Triton glue: the only code that touches ``triton_python_backend_utils``.

Each adapter converts Triton tensors to the typed objects of ``disagg.serving`` and back; the logic
lives there. ``pb_utils`` is passed in (it only exists inside the Python backend stub).
"""
