//! TLS for the Redis store: the client's certificates from the configured PEM files, and a
//! refused handshake turned into an error that names the setting to fix.

use super::*;

/// The configuration error for a TLS handshake refused over certificates: `key` and `why` as
/// [`tls_rejection`] found them, shown with the setting's file (or the URL).
pub(super) fn tls_refused(
    inner: &Inner,
    e: &redis::RedisError,
    key: &'static str,
    why: &str,
) -> Error {
    let tls = inner.options.tls.as_ref();
    let file = match key {
        "remote.tls_ca_file" => tls.and_then(|t| t.ca.as_ref()),
        "remote.tls_cert_file" => tls.and_then(|t| t.client.as_ref().map(|(c, _)| c)),
        _ => None,
    };
    let shown = match (key, file) {
        ("remote.url", _) => inner.url.to_string(),
        (_, Some(f)) => f.path.display().to_string(),
        (_, None) => "(not set)".to_string(),
    };
    Error::invalid_config(
        key,
        shown,
        format!("TLS with {} failed: {why} ({e})", inner.url),
    )
}

/// What is wrong with a PEM file, in words that never quote the file (the parser's own errors
/// can carry its bytes: a key's, for a key file).
pub(super) fn pem_problem(e: &rustls::pki_types::pem::Error) -> &'static str {
    use rustls::pki_types::pem::Error as E;
    match e {
        E::NoItemsFound => "no -----BEGIN …----- block of the expected kind",
        E::MissingSectionEnd { .. } => {
            "a -----BEGIN …----- block has no -----END …----- line (a PEM flattened onto one line?)"
        }
        E::IllegalSectionStart { .. } => "a malformed -----BEGIN …----- line",
        E::Base64Decode(_) => "a block's base64 does not decode",
        E::SectionTooLarge => "a block is too large",
        _ => "the file is not valid PEM",
    }
}

/// Whether a rustls certificate error is about the name the server was reached by, not its
/// issuer (`remote.url`'s host is not among the certificate's names).
pub(super) fn name_mismatch(c: &rustls::CertificateError) -> bool {
    matches!(
        c,
        rustls::CertificateError::NotValidForName
            | rustls::CertificateError::NotValidForNameContext { .. }
    )
}

/// Parses and checks the TLS files: every file holds what it should, the CA's certificates are
/// usable trust anchors, the key is of a supported type and belongs to the first certificate.
pub(super) fn tls_certificates(files: &RemoteTlsFiles) -> Result<redis::TlsCertificates> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let bad = |f: &PemFile, why: String| Error::invalid_config(f.key, f.path.display(), why);
    let certificates = |f: &PemFile| -> Result<Vec<CertificateDer<'static>>> {
        let certs = CertificateDer::pem_slice_iter(&f.bytes)
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| {
                bad(
                    f,
                    format!("not a PEM certificate file: {}", pem_problem(&e)),
                )
            })?;
        if certs.is_empty() {
            return Err(bad(
                f,
                "holds no certificate (no -----BEGIN CERTIFICATE----- block)".to_string(),
            ));
        }
        Ok(certs)
    };
    if let Some(ca) = &files.ca {
        let mut roots = rustls::RootCertStore::empty();
        for (k, cert) in certificates(ca)?.into_iter().enumerate() {
            roots
                .add(cert)
                .map_err(|e| bad(ca, format!("certificate {k} is not a usable CA ({e})")))?;
        }
    }
    if let Some((cert, key)) = &files.client {
        let chain = certificates(cert)?;
        // Never show the key's contents: some of the PEM parser's errors carry the file's
        // bytes, so only a fixed description is shown.
        let der = PrivateKeyDer::from_pem_slice(&key.bytes).map_err(|e| {
            bad(
                key,
                format!("holds no PEM private key: {}", pem_problem(&e)),
            )
        })?;
        let provider = rustls::crypto::ring::default_provider();
        rustls::sign::CertifiedKey::from_der(chain, der, &provider).map_err(|e| {
            let f = if matches!(e, rustls::Error::InconsistentKeys(_)) {
                cert
            } else {
                key
            };
            bad(
                f,
                format!("the client key and certificate cannot be used together ({e})"),
            )
        })?;
    }
    Ok(redis::TlsCertificates {
        client_tls: files.client.as_ref().map(|(c, k)| redis::ClientTlsConfig {
            client_cert: c.bytes.clone(),
            client_key: k.bytes.clone(),
        }),
        root_cert: files.ca.as_ref().map(|c| c.bytes.clone()),
    })
}

/// Whether `e` is a TLS handshake the other side or we refused over certificates, and then the
/// setting to fix with a reason: an untrusted server certificate (`remote.tls_ca_file`), or a
/// server that wants a (different) client certificate (`remote.tls_cert_file`).
pub(super) fn tls_rejection(e: &redis::RedisError) -> Option<(&'static str, String)> {
    use std::error::Error as _;
    let mut source = e.source();
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            if let Some(t) = io.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
                return tls_error_setting(t);
            }
        }
        if let Some(t) = s.downcast_ref::<rustls::Error>() {
            return tls_error_setting(t);
        }
        source = s.source();
    }
    // The cluster client reports its seeds' failures as text only ("Failed to create initial
    // connections - IoError: invalid peer certificate: UnknownIssuer"): read rustls's wording.
    let text = e.to_string();
    if let Some(i) = text.find("invalid peer certificate: ") {
        let what: String = text[i + "invalid peer certificate: ".len()..]
            .chars()
            .take(300)
            .collect();
        // rustls words it "certificate not valid for name …" (older: `NotValidForName`).
        if what.starts_with("certificate not valid for name") || what.starts_with("NotValidForName")
        {
            return Some((
                "remote.url",
                format!(
                    "the server's certificate does not name the host it was reached by ({what})"
                ),
            ));
        }
        return Some((
            "remote.tls_ca_file",
            format!("the server's certificate is not trusted ({what})"),
        ));
    }
    if let Some(i) = text.find("received fatal alert: ") {
        let alert = text[i + "received fatal alert: ".len()..]
            .split(|c: char| !c.is_ascii_alphanumeric())
            .next()
            .unwrap_or("");
        if let Some(a) = CERTIFICATE_ALERTS
            .iter()
            .find(|a| format!("{a:?}") == alert)
        {
            return Some(client_certificate_refused(*a));
        }
    }
    None
}

/// The alerts by which a server refuses (or asks for) our client certificate.
pub(super) const CERTIFICATE_ALERTS: [rustls::AlertDescription; 8] = {
    use rustls::AlertDescription as A;
    [
        A::CertificateRequired,
        A::BadCertificate,
        A::UnknownCA,
        A::CertificateUnknown,
        A::UnsupportedCertificate,
        A::CertificateRevoked,
        A::CertificateExpired,
        A::AccessDenied,
    ]
};

pub(super) fn client_certificate_refused(a: rustls::AlertDescription) -> (&'static str, String) {
    (
        "remote.tls_cert_file",
        format!("the server refused our client certificate (alert {a:?})"),
    )
}

pub(super) fn tls_error_setting(t: &rustls::Error) -> Option<(&'static str, String)> {
    match t {
        rustls::Error::InvalidCertificate(c) if name_mismatch(c) => Some((
            "remote.url",
            format!("the server's certificate does not name the host it was reached by ({c:?})"),
        )),
        rustls::Error::InvalidCertificate(c) => Some((
            "remote.tls_ca_file",
            format!("the server's certificate is not trusted ({c:?})"),
        )),
        rustls::Error::AlertReceived(a) if CERTIFICATE_ALERTS.contains(a) => {
            Some(client_certificate_refused(*a))
        }
        _ => None,
    }
}
