-- The cost of a PostgreSQL round trip itself: a prepared SELECT 1, no table, no write.
SELECT 1;
