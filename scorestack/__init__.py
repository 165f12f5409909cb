"""scorestack: compile classical ML models into the fastest verified Triton artifacts and serve them."""

__version__ = "0.1.0"
