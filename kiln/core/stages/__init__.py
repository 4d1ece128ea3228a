"""The body of each run stage, as plain functions over ``kiln.core.stages`` records.

Activities call these; they know nothing about Temporal, so they are testable on their own.
"""
