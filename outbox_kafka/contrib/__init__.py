"""Adapters for frameworks that do not hand out SQLAlchemy connections."""
