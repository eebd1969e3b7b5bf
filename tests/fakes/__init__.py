"""Faithful CPU fakes of frameworks that need hardware the CI machine lacks."""
