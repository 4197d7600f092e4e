"""Certification of the driver's hooks on the booted model: the equations, the weight checks, and what the driver serves after them."""
