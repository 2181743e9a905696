use pgrx::prelude::*;

#[pg_schema]
mod tests {
    use pgrx::prelude::*;

    #[pg_test]
    fn claim_new_then_replay() {
        let o =
            Spi::get_one::<String>("SELECT (idempotency.claim('k1', '{\"a\":1}')).outcome::text")
                .unwrap();
        assert_eq!(o.as_deref(), Some("new"));
    }
}
