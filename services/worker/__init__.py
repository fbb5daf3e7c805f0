"""Building candidates into shared libraries (local worker processes now; RQ workers later)."""
