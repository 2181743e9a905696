//! The client of the external payment service. It is given the derived key as *its*
//! Idempotency-Key, so calling it again with the same key never refunds twice.

use std::time::Duration;

use axum::body::Bytes;
use axum::http::{header, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use idempotency_axum::key::sf_string;

pub enum CallError {
    /// Nothing reached the payment service (connection refused, bad address): safe to release.
    Unreachable(String),
    /// The request may or may not have been carried out (timeout, connection lost mid-request).
    Ambiguous(String),
}

pub struct Provider {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
    timeout: Duration,
}

impl Provider {
    pub fn new(base: &str, timeout: Duration) -> Provider {
        let client = Client::builder(TokioExecutor::new())
            // A new connection per call: a provider that restarted leaves no stale pooled one.
            .pool_max_idle_per_host(0)
            .build_http();
        Provider {
            client,
            base: base.trim_end_matches('/').to_string(),
            timeout,
        }
    }

    /// `POST <base>/refunds` with `Idempotency-Key: "<key>"`; the status and body it answered.
    pub async fn refund(&self, key: &str, body: String) -> Result<(StatusCode, Bytes), CallError> {
        let uri: Uri = format!("{}/refunds", self.base)
            .parse()
            .map_err(|e| CallError::Unreachable(format!("bad PAYMENT_URL: {e}")))?;
        let req = Request::post(uri)
            .header(header::CONTENT_TYPE, "application/json")
            .header("idempotency-key", sf_string(key))
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| CallError::Unreachable(format!("cannot build the request: {e}")))?;
        let call = async {
            let res = self.client.request(req).await.map_err(|e| {
                if e.is_connect() {
                    CallError::Unreachable(format!("{e:?}"))
                } else {
                    CallError::Ambiguous(format!("{e:?}"))
                }
            })?;
            let status = res.status();
            let bytes = res
                .into_body()
                .collect()
                .await
                .map_err(|e| CallError::Ambiguous(format!("reading the answer: {e}")))?
                .to_bytes();
            Ok((status, bytes))
        };
        match tokio::time::timeout(self.timeout, call).await {
            Ok(r) => r,
            Err(_) => Err(CallError::Ambiguous(format!(
                "no answer within {} ms",
                self.timeout.as_millis()
            ))),
        }
    }
}
