-- idempotency 0.5.0 -> 0.6.0 (see CHANGELOG.md)
--
-- Every object is left as a fresh 0.6.0 install creates it (tests/integration/test_upgrade.py
-- compares the two catalogs).

\echo Use "ALTER EXTENSION idempotency UPDATE TO '0.6.0'" to load this file. \quit
